"""The local secret store: `$AIR_HOME/secrets.json`, readable by its owner only.

A workload names secrets as `ENV_NAME: scope/key`; `resolve_secrets` turns those into values at launch
time, so values never sit in a YAML file, the run store, or dry-run output (`mask_secrets` hides any that
leak into text). A run's lines are masked where they are written (air.launcher.redact, in the pump), so
its files never hold a value; `masker_for_run` masks again when they are read, for logs an older air
wrote, and fails closed: no masking, no lines. The
file is created with mode 0600 (never briefly wider), rewritten atomically under a lock, and refused
when its permissions let anyone else read it: a store that leaked once is not trusted.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import stat
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from air.errors import AirError, NotFoundError, SecretMaskingError, UserInputError
from air.files import atomic_write_text
from air.home import AirHome
from air.launcher.redact import Redactor

_FORMAT_VERSION = 1
#: Scope and key names: the charset of the hosted product's secret scopes (no '/', which separates them).
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")

Store = dict[str, dict[str, str]]


def secrets_path(store: Path | None = None) -> Path:
    """The secret store file (`$AIR_HOME/secrets.json` unless a path is given, as tests do)."""
    return Path(store) if store is not None else AirHome(create=False).secrets


def parse_secret_ref(ref: str, field: str = "secrets") -> tuple[str, str]:
    """Split `scope/key` (exactly one '/', both parts valid names); `field` names it in the error."""
    parts = ref.split("/") if isinstance(ref, str) else []
    if len(parts) != 2 or not all(_NAME_RE.match(p) for p in parts):
        raise UserInputError(
            f"{field}: {ref!r} is not a secret reference of the form scope/key",
            hint="Scope and key are 1-128 characters of letters, digits, '_', '.' and '-', "
            "e.g. `HF_TOKEN: huggingface/token`.",
        )
    return parts[0], parts[1]


def _check_name(what: str, name: str) -> None:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise UserInputError(
            f"secret {what} {name!r} is not valid",
            hint="Use 1-128 characters of letters, digits, '_', '.' and '-'.",
        )


def put_secret(scope: str, key: str, value: str, *, store: Path | None = None) -> None:
    """Add or replace one secret."""
    _check_name("scope", scope)
    _check_name("key", key)
    if not isinstance(value, str):
        raise UserInputError(f"secret {scope}/{key}: the value must be text")
    with _locked(secrets_path(store)) as path:
        data = _read(path)
        data.setdefault(scope, {})[key] = value
        _write(path, data)


def delete_secret(scope: str, key: str, *, store: Path | None = None) -> None:
    """Remove one secret (and its scope when it was the last one); NotFoundError if absent."""
    with _locked(secrets_path(store)) as path:
        data = _read(path)
        if key not in data.get(scope, {}):
            raise NotFoundError(
                f"no secret {scope}/{key} in {path}", hint="List the stored ones with `air secrets list`."
            )
        del data[scope][key]
        if not data[scope]:
            del data[scope]
        _write(path, data)


def list_secrets(*, store: Path | None = None) -> list[tuple[str, str]]:
    """Every stored (scope, key), sorted. Never the values."""
    data = _read(secrets_path(store))
    return sorted((scope, key) for scope, keys in data.items() for key in keys)


def resolve_secrets(mapping: Mapping[str, str], *, store: Path | None = None) -> dict[str, str]:
    """`{ENV_NAME: "scope/key"}` → `{ENV_NAME: value}`; every missing secret is named in one error."""
    if not mapping:
        return {}
    refs = {env: parse_secret_ref(ref, f"secrets.{env}") for env, ref in mapping.items()}
    path = secrets_path(store)
    data = _read(path)
    values: dict[str, str] = {}
    missing: list[tuple[str, str, str]] = []
    for env, (scope, key) in refs.items():
        if key in data.get(scope, {}):
            values[env] = data[scope][key]
        else:
            missing.append((env, scope, key))
    if missing:
        listed = ", ".join(f"{scope}/{key} (for {env})" for env, scope, key in missing)
        commands = "\n".join(
            f"  air secrets put {scope} {key}" for scope, key in dict.fromkeys((s, k) for _, s, k in missing)
        )
        raise UserInputError(
            f"secrets: not in the local secret store {path}: {listed}",
            hint=f"Add {'it' if len(missing) == 1 else 'them'} (the value is read from stdin):\n{commands}",
        )
    return values


def mask_secrets(text: str, values: Iterable[str]) -> str:
    """Replace every occurrence of a secret value in `text` with `***`.

    Longest values first, so a secret that contains another is hidden whole; the lines of a multi-line
    secret (a PEM key) are also hidden one by one, since logs arrive line by line (the pump's rules:
    air.launcher.redact).
    """
    return Redactor(values).mask_text(text)


class RunMasker:
    """Hides one run's secret values in its log lines; built by `masker_for_run`."""

    def __init__(self, run_id: str, submission: Path | None, store: Path | None) -> None:
        self.run_id, self.submission, self.store = run_id, submission, store
        self.values: list[str] | None = [] if submission is None else None
        self._redactor: Redactor | None = None

    def resolve(self) -> list[str]:
        """The values to hide (read once). Raises SecretMaskingError when they cannot all be known."""
        if self.values is None:
            self.values = list(self._resolve().values())
        return self.values

    def _resolve(self) -> dict[str, str]:
        if self.submission is None:
            return {}
        try:
            plan = json.loads(self.submission.read_text())
            refs = plan.get("secret_refs") or {}
            if self.store is None and plan.get("secret_store"):  # an `air server` user's secrets
                self.store = Path(plan["secret_store"])
        except (OSError, ValueError, AttributeError) as exc:
            raise SecretMaskingError(
                f"Not showing the logs of run {self.run_id}: its launch plan {self.submission} cannot be read "
                f"({exc}), so air cannot tell which secret values to hide.",
                hint=f"The raw log files are under {self.submission.parent} if you accept reading them unmasked.",
            ) from exc
        try:
            return resolve_secrets(refs, store=self.store)
        except AirError as exc:  # deleted/renamed secret, unreadable store, malformed reference
            raise SecretMaskingError(
                f"Not showing the logs of run {self.run_id}: it was given secrets that cannot be resolved "
                f"now, so their values could not be hidden should the logs contain them. {exc.message}",
                hint=(exc.hint + "\n" if exc.hint else "")
                + "Then run the command again. (Put back the value the run was given: only that value is hidden.)",
            ) from exc

    def __call__(self, text: str) -> str:
        return self._built().mask_text(text)

    def split(self, text: str) -> tuple[str, str]:
        """A piece of a line too long to hold whole: (what can be shown now, masked; the raw rest to
        put before the next piece), so a value cut by the piece boundary is still hidden whole."""
        return self._built().split_text(text)

    def _built(self) -> Redactor:
        if self._redactor is None:
            self._redactor = Redactor(self.resolve())
        return self._redactor


def masker_for_run(
    run_id: str, submission: Path | None, *, store: Path | None = None
) -> Callable[[str], str]:
    """A function hiding `run_id`'s secret values in its log lines, failing CLOSED.

    `submission` is the run's launch plan (`RunPaths.submission`, which names its secret references), or
    None for a run that is given no secrets (a `@distributed` call). The references are resolved now when
    the plan exists, so an error comes before any line is printed; else at the first line (a run still
    in setup has printed nothing). When a reference cannot be resolved (the secret was deleted from the
    store after submit, the store became unreadable) this raises `SecretMaskingError`, naming the secret
    and how to put it back, instead of printing lines that may hold its value: redacting every line
    instead would print nothing useful while looking like output, and printing unmasked leaks.
    """
    masker = RunMasker(run_id, submission, store)
    if submission is not None and submission.exists():
        masker.resolve()
    return masker


# ---- the file -------------------------------------------------------------------------------------


@contextmanager
def _locked(path: Path) -> Iterator[Path]:
    """Serialise read-modify-write of the store between concurrent `air secrets put` commands."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield path
    finally:
        os.close(fd)  # releases the lock


def _read(path: Path) -> Store:
    """Read the store; a missing file is an empty store; a file others can read is refused."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise UserInputError(f"cannot open the secret store {path}: {exc.strerror}") from exc
    with os.fdopen(fd, "r", encoding="utf-8") as f:
        st = os.fstat(f.fileno())
        if st.st_mode & 0o077:
            raise UserInputError(
                f"the secret store {path} has mode {stat.S_IMODE(st.st_mode):04o}: other users may "
                f"read it, so air will not use it",
                hint=f"Restrict it with `chmod 600 {path}` (and rotate any secret that may have leaked).",
            )
        if hasattr(os, "getuid") and st.st_uid != os.getuid():
            raise UserInputError(
                f"the secret store {path} belongs to another user (uid {st.st_uid}), so air will not use it"
            )
        text = f.read()
    try:
        doc = json.loads(text) if text.strip() else {}
        scopes = doc.get("scopes", {}) if isinstance(doc, dict) else None
        if not isinstance(scopes, dict) or not all(
            isinstance(keys, dict) and all(isinstance(v, str) for v in keys.values())
            for keys in scopes.values()
        ):
            raise ValueError("expected {'version': 1, 'scopes': {scope: {key: value}}}")
    except ValueError as exc:
        raise UserInputError(f"the secret store {path} is not valid: {exc}") from exc
    return scopes


def _write(path: Path, data: Store) -> None:
    """Write atomically: a temporary file that is 0600 from its creation (mkstemp), fsync, rename."""
    text = json.dumps({"version": _FORMAT_VERSION, "scopes": data}, indent=2, sort_keys=True) + "\n"
    atomic_write_text(path, text, mode=0o600)

