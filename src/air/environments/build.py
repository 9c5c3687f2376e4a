"""Building an environment with uv, layered on the base interpreter.

* **Layered, not copied.** A run's environment holds only what its dependencies add. The base
  interpreter's site folders (torch, air itself, editable installs) are put behind the environment's own
  `site-packages` by a `.pth` file that calls `site.addsitedir`, so the base's packages are visible and
  an environment's own version of a package wins. We do not rely on `--system-site-packages`: when the
  base is itself a virtual environment (the usual case) that flag exposes the *system* interpreter's
  packages, not the base venv's.
* **uv does not look at layered packages** (astral-sh/uv#2500, #4466): left alone it would reinstall
  torch into every environment. So the packages the base already has are left out of uv's resolution
  (an override `name ; python_version < '0'`, which every uv understands), except those that a
  dependency needs in another version: after each install we check every installed requirement against
  the base's versions and let uv install the ones the base cannot satisfy (pip's "requirement already
  satisfied", done with uv).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from air.environments.dependencies import Dependency, DependencySet, canonical_name, without_hashes
from air.environments.key import interpreter_identity
from air.environments.layout import (
    COMPLETE,
    EXCLUDES,
    LAYER_PTH,
    META,
    REQUIREMENTS,
    SCHEMA,
)
from air.errors import EnvironmentBuildError
from air.files import atomic_write_text

if TYPE_CHECKING:
    from packaging.requirements import Requirement

#: At most this many install rounds while working out which base packages need another version.
_MAX_INSTALL_ROUNDS = 5

Log = Callable[[str], None]


def build_environment(deps: DependencySet, base: Path, key: str, path: Path, log: Log) -> None:
    """Build at the final path (a venv holds absolute paths), marker last; remove everything on failure."""
    started = time.monotonic()
    if path.exists():
        log(f"air: removing the unfinished environment {key} left by an interrupted build")
        shutil.rmtree(path)
    log(f"air: building environment {key} on {base} ({len(deps.dependencies)} dependencies)")
    for warning in deps.warnings:
        log(f"air: warning: {warning}")
    try:
        uv = _uv_bin()
        _run([uv, "venv", "--python", str(base), "--no-project", str(path)], log, deps, what="create the venv",
             only=[])
        layer = _layer_base(base, path, log)
        excluded, satisfied = _install(deps, path, layer, log, uv)
        linked = _link_base_scripts(layer.base_scripts, path / "bin")  # after installing: ours win
        log(f"air: {linked} of the base's scripts (torchrun, ray, …) run with this environment")
        meta = {
            "key": key,
            "schema": SCHEMA,
            "base_python": str(base),
            "base_version": interpreter_identity(base)["version"],
            "dependencies": deps.lines(),
            "source": str(deps.source) if deps.source else None,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "build_seconds": round(time.monotonic() - started, 3),
            "satisfied_by_base": satisfied,
            "excluded_from_base": excluded,
        }
        atomic_write_text(path / META, json.dumps(meta, indent=2))
        atomic_write_text(path / COMPLETE, key)
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    log(f"air: environment {key} ready in {time.monotonic() - started:.1f}s")


def uv_bin() -> str:
    """The uv binary builds run (a walled build binds its folder into the run's view)."""
    return _uv_bin()


def _uv_bin() -> str:
    try:
        from uv import find_uv_bin

        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        found = shutil.which("uv")
        if found:
            return found
        raise EnvironmentBuildError(
            "uv is not installed, so environment.dependencies cannot be installed.",
            hint="pip install uv (it is a dependency of air-runtime).",
        ) from None


def _uv_env() -> dict[str, str]:
    env = dict(os.environ)
    env["NO_COLOR"] = "1"
    env.pop("VIRTUAL_ENV", None)  # we always say --python; an active venv must not confuse anything
    return env


def _run(cmd: list[str], log: Log, deps: DependencySet, *, what: str, only: list[Dependency] | None = None) -> None:
    """Run an installer command, every output line to `log`; a failure becomes EnvironmentBuildError."""
    lines: list[str] = []
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
        errors="replace", env=_uv_env(),
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = _redact(line.rstrip("\n"))
            lines.append(line)
            log(line)
        rc = proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if rc != 0:
        raise _build_error(lines, only if only is not None else list(deps.dependencies), what)


def _redact(text: str) -> str:
    """Index credentials in installer output (uv hides most; this catches the rest)."""
    return re.sub(r"(?<=://)[^/@\s]+@", "***@", text)


def _build_error(lines: list[str], candidates: list[Dependency], what: str) -> EnvironmentBuildError:
    """Name the dependency the installer complained about, with its error line (and causes)."""
    start = next((i for i, line in enumerate(lines) if line.startswith("error:")), None)
    if start is None:
        detail = next((line for line in reversed(lines) if line.strip()), "the installer failed")
    else:
        parts = [lines[start][len("error:"):].strip()]
        for line in lines[start + 1:]:  # the causes uv prints under its error line, indented
            stripped = line.strip()
            if line and not line[0].isspace() and not stripped.startswith(("Caused by:", "╰─▶")):
                break
            if not stripped or stripped.startswith("help:"):
                continue
            for prefix in ("cause:", "Caused by:", "╰─▶"):
                if stripped.startswith(prefix):
                    stripped = stripped[len(prefix):].strip()
            parts.append(stripped)
        detail = parts[0] + (": " + " ".join(parts[1:]) if len(parts) > 1 else "")
    lowered = detail.lower()
    named = [d for d in candidates if _mentioned(d, lowered)] or candidates
    names = ", ".join(repr(d.display) for d in named)
    message = f"could not install {names}: {detail}" if named else f"could not {what}: {detail}"
    err = EnvironmentBuildError(
        message,
        hint="The installer's full output is in the node log. Fix environment.dependencies (or the index "
        "options), or check that the package exists for this Python and platform.",
    )
    err.dependencies = [d.display for d in named]  # type: ignore[attr-defined]
    return err


def _mentioned(dep: Dependency, text: str) -> bool:
    words = set()
    if dep.name:
        words |= {dep.name, dep.name.replace("-", "_")}
    if dep.local_path is not None:
        words.add(dep.local_path.name.lower())
    return any(re.search(rf"(?<![\w.-]){re.escape(w)}(?![\w-])", text) for w in words if w)


_PROBE_BASE = r"""
import importlib.metadata as md, json, os, platform, re, site, sys, sysconfig
if sys.path and sys.path[0] in ("", os.getcwd()):
    sys.path.pop(0)  # -c puts the working folder first; an environment does not see it
dirs = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
if site.ENABLE_USER_SITE:
    dirs.append(site.getusersitepackages())
seen, dists = set(), []
for dist in md.distributions():  # in sys.path order: the first of each name is the one imported
    path = getattr(dist, "_path", None)
    stem = os.path.basename(str(path))[: -len(".dist-info")] if str(path).endswith(".dist-info") else ""
    if stem.count("-") == 1:  # name-version.dist-info: no need to parse METADATA
        name, version = stem.split("-")
    else:
        name, version = dist.metadata["Name"], dist.version
    key = re.sub(r"[-_.]+", "-", name).lower() if name else None
    if key and key not in seen:
        seen.add(key)
        dists.append({"name": key, "version": version, "path": str(path) if path is not None else None})
impl = sys.implementation
iver = "{0.major}.{0.minor}.{0.micro}".format(impl.version)
if impl.version.releaselevel != "final":
    iver += impl.version.releaselevel[0] + str(impl.version.serial)
markers = {
    "implementation_name": impl.name, "implementation_version": iver, "os_name": os.name,
    "platform_machine": platform.machine(), "platform_release": platform.release(),
    "platform_system": platform.system(), "platform_version": platform.version(),
    "python_full_version": platform.python_version(),
    "platform_python_implementation": platform.python_implementation(),
    "python_version": ".".join(platform.python_version_tuple()[:2]), "sys_platform": sys.platform,
}
print(json.dumps({
    "site_dirs": [p for p in sys.path if p in set(dirs)] + [p for p in dirs if p not in sys.path],
    "scripts": sysconfig.get_paths()["scripts"], "dists": dists, "markers": markers,
}))
"""


@dataclass
class _Dist:
    """A distribution the environment sees; its requirements are read only when a check needs them."""

    name: str
    version: str
    own: bool  # installed in the environment itself (else: seen through the base layer)
    path: str | None  # its .dist-info / .egg-info folder

    @functools.cached_property
    def requires(self) -> tuple[str, ...]:
        if self.path is None:
            return ()
        import importlib.metadata  # build time only: keep it off the cache-hit path

        return tuple(importlib.metadata.PathDistribution(Path(self.path)).requires or ())


@dataclass(frozen=True)
class _Layer:
    """The environment's own site-packages, and what the base interpreter puts behind it."""

    site_packages: Path
    base_dists: dict[str, _Dist]
    markers: dict[str, str]  # PEP 508 marker values of the interpreter
    base_scripts: Path  # the base's bin/ (console scripts)

    def dists(self) -> dict[str, _Dist]:
        """What the environment's python sees now: its own distributions first, then the base's."""
        import importlib.metadata

        own: dict[str, _Dist] = {}
        for dist in importlib.metadata.distributions(path=[str(self.site_packages)]):
            name = canonical_name(dist.metadata["Name"] or "")
            if name and name not in own:
                own[name] = _Dist(name, dist.version, True, str(getattr(dist, "_path", "")) or None)
        return {**self.base_dists, **own}


def _layer_base(base: Path, path: Path, log: Log) -> _Layer:
    """Put the base interpreter's site folders behind the environment's own, and its scripts in bin/."""
    info = json.loads(_check_output([str(base), "-E", "-c", _PROBE_BASE], "inspect the base interpreter"))
    found = sorted(path.glob("lib/*/site-packages"))
    if len(found) != 1:
        raise EnvironmentBuildError(f"Unexpected virtual environment layout at {path} (site-packages: {found}).")
    site_packages = found[0]
    site_dirs = tuple(d for d in info["site_dirs"] if os.path.isdir(d))
    pth = "import site; " + "; ".join(f"site.addsitedir({d!r})" for d in site_dirs) if site_dirs else ""
    (site_packages / LAYER_PTH).write_text(pth + "\n")
    log(f"air: layered on {len(site_dirs)} site folder(s) of {base}")
    base_dists = {d["name"]: _Dist(d["name"], d["version"], False, d["path"]) for d in info["dists"]}
    return _Layer(site_packages, base_dists, info["markers"], Path(info["scripts"]))


def _check_output(cmd: list[str], what: str) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", env=_uv_env())
    if proc.returncode != 0:
        raise EnvironmentBuildError(f"could not {what}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def _link_base_scripts(base_scripts: Path, env_bin: Path) -> int:
    """Copy the base's console scripts (torchrun, ray, mlflow…) with this environment's python in the
    shebang, so they see its packages; other executables are linked. Names the env has are kept."""
    if not base_scripts.is_dir() or base_scripts.resolve() == env_bin.resolve():
        return 0
    env_python = env_bin / "python"
    count = 0
    for entry in os.scandir(base_scripts):
        name = entry.name
        target = env_bin / name
        if name.lower().startswith(("python", "activate", "deactivate")) or os.path.lexists(target):
            continue
        if not entry.is_file() or not os.access(entry.path, os.X_OK):
            continue
        try:
            with open(entry.path, "rb") as fh:
                head = fh.read(4096)
        except OSError:
            continue
        rewritten = _reshebang(head, entry.path, base_scripts, env_python)
        if rewritten is None:
            os.symlink(entry.path, target)
        else:
            target.write_bytes(rewritten)
            target.chmod(0o755)
        count += 1
    return count


def _reshebang(head: bytes, script: str, base_scripts: Path, env_python: Path) -> bytes | None:
    """The script with our python in its shebang, or None when it is not a script for the base python."""
    if not head.startswith(b"#!") or b"\0" in head:
        return None
    base_prefix = str(base_scripts).encode() + b"/python"
    lines = head.split(b"\n", 2)
    if lines[0].startswith(b"#!" + base_prefix):
        header_lines = 1
    elif lines[0].strip() == b"#!/bin/sh" and len(lines) > 1 and base_prefix in lines[1] and b"exec" in lines[1]:
        header_lines = 2  # the long-path form: '''exec' "/path/python" "$0" "$@"
    else:
        return None
    try:
        with open(script, "rb") as fh:
            body = fh.read().split(b"\n", header_lines)[header_lines]
    except (OSError, IndexError):
        return None
    python = str(env_python).encode()
    if len(python) + 2 <= 127 and b" " not in python:
        header = b"#!" + python + b"\n"
    else:
        header = b"#!/bin/sh\n'''exec' \"" + python + b"\" \"$0\" \"$@\"\n' '''\n"
    return header + body


def _install(deps: DependencySet, path: Path, layer: _Layer, log: Log, uv: str) -> tuple[list[str], list[str]]:
    """Install `deps`, letting uv leave alone what the base already satisfies. Returns (excluded, satisfied)."""
    if deps.is_empty:
        return [], []
    checker = _Checker.create()
    dists, markers = layer.dists(), layer.markers
    base_names = {name for name, d in dists.items() if not d.own}
    must_install = set()
    satisfied: list[str] = []
    extra_lines: list[str] = []
    for dep in deps.dependencies:
        if dep.name is None:
            continue
        if checker is None or dep.local_path is not None or dep.url or dep.editable or dep.flags:
            must_install.add(dep.name)
            continue
        verdict = checker.direct(dep, dists, markers)
        if verdict is None:
            must_install.add(dep.name)
        else:
            satisfied.append(f"{dep.display} ({dep.name} {dists[dep.name].version})")
            extra_lines.extend(verdict)
    if checker is None:
        # Without `packaging` we cannot compare versions; let uv install every direct requirement.
        log("air: warning: the `packaging` module is missing; base packages are reused only as dependencies")
    excluded = base_names - must_install
    for line in satisfied:
        log(f"air: requirement satisfied by the base environment: {line}")

    plain = [d for d in deps.dependencies if not d.flags]
    scoped = [d for d in deps.dependencies if d.flags]
    options = [arg for o in deps.options for arg in ([o.flag, o.value] if o.value is not None else [o.flag])]
    # uv reuses its cached build of a local folder while its pyproject.toml is unchanged: our key saw the
    # content change, so make uv rebuild (and re-read local archives) too.
    local = [d for d in deps.dependencies if d.local_path is not None]
    rebuild = ["--reinstall"] if any(d.name is None for d in local) else []
    rebuild += [arg for d in local if d.name for arg in ("--reinstall-package", d.name)]
    for round_number in range(_MAX_INSTALL_ROUNDS):
        (path / EXCLUDES).write_text("".join(f"{name} ; python_version < '0'\n" for name in sorted(excluded)))
        requirements = [d.line for d in plain if d.name is None or d.name not in excluded] + sorted(set(extra_lines))
        (path / REQUIREMENTS).write_text("".join(f"{line}\n" for line in requirements))
        common = [uv, "pip", "install", "--python", str(path / "bin" / "python"), *options,
                  *(rebuild if round_number == 0 else []), "--overrides", str(path / EXCLUDES)]
        if requirements:
            _run([*common, "-r", str(path / REQUIREMENTS)], log, deps, what="install the dependencies",
                 only=[d for d in plain if d.name is None or d.name not in excluded])
        if round_number == 0:
            for number, dep in enumerate(scoped):
                single = path / f"air-requirements-{number + 1}.txt"  # installed on its own, with its flags
                single.write_text(dep.line + "\n")
                _run([*common, *dep.flags, "-r", str(single)], log, deps, what=f"install {dep.display}", only=[dep])
        if checker is None:
            break
        dists = layer.dists()
        need_own, more_lines = checker.unsatisfied(dists, markers, excluded)
        new_lines = set(more_lines) - set(extra_lines)
        if not need_own and not new_lines:
            break
        for name, wanted in sorted(need_own.items()):
            log(f"air: {name} {dists[name].version} from the base does not satisfy {', '.join(wanted)}; "
                "installing another version into the environment")
        excluded -= set(need_own)
        extra_lines.extend(sorted(new_lines))
    else:
        log("air: warning: some requirements may still not be satisfied by the base environment's versions")
    return sorted(excluded), satisfied


class _Checker:
    """Version and marker checks (with `packaging`), used to decide what the base already satisfies."""

    def __init__(self, requirement: type[Requirement], invalid: type[Exception]) -> None:
        self._requirement = requirement
        self._invalid = invalid

    @classmethod
    def create(cls) -> _Checker | None:
        try:
            from packaging.requirements import InvalidRequirement, Requirement
        except ImportError:  # pragma: no cover
            return None
        return cls(Requirement, InvalidRequirement)

    def _parse(self, text: str) -> Requirement | None:
        try:
            return self._requirement(without_hashes(text))
        except self._invalid:
            return None

    def _applies(self, req: Requirement, markers: dict[str, str], extra: str = "") -> bool:
        return req.marker is None or req.marker.evaluate({**markers, "extra": extra})

    def _version_ok(self, req: Requirement, dist: _Dist) -> bool:
        return bool(req.specifier.contains(dist.version, prereleases=True))

    def _missing_extras(self, req: Requirement, dist: _Dist, dists: dict[str, _Dist], markers: dict[str, str]) -> list[str]:
        """Requirement lines that `req`'s extras add to `dist` and the visible packages do not satisfy."""
        missing = []
        for extra in req.extras:
            for line in dist.requires:
                sub = self._parse(line)
                if sub is None or not self._applies(sub, markers, canonical_name(extra)):
                    continue
                if self._applies(sub, markers, ""):
                    continue  # a plain requirement of the dist, not added by the extra
                target = dists.get(canonical_name(sub.name))
                if target is None or not self._version_ok(sub, target):
                    missing.append(str(sub).split(";")[0].strip())
        return missing

    def direct(self, dep: Dependency, dists: dict[str, _Dist], markers: dict[str, str]) -> list[str] | None:
        """For a direct requirement the base already has: lines its extras still need, or None when the
        base's version does not do (uv must install it)."""
        req = self._parse(dep.line)
        if req is None or dep.name not in dists or not self._applies(req, markers):
            return None
        dist = dists[dep.name]
        if not self._version_ok(req, dist):
            return None
        return self._missing_extras(req, dist, dists, markers)

    def unsatisfied(
        self, dists: dict[str, _Dist], markers: dict[str, str], excluded: set[str]
    ) -> tuple[dict[str, list[str]], list[str]]:
        """After an install: base packages that must come in another version (with the requirements the
        base's version fails), and the requirement lines to install next."""
        need_own: dict[str, list[str]] = {}
        lines: list[str] = []
        for dist in dists.values():
            if not dist.own:
                continue
            for text in dist.requires:
                req = self._parse(text)
                if req is None or not self._applies(req, markers):
                    continue
                name = canonical_name(req.name)
                target = dists.get(name)
                # A missing target was installed with --no-deps on purpose (uv resolved everything else).
                if target is not None and not target.own and name in excluded:
                    if not self._version_ok(req, target):
                        wanted = str(req).split(";")[0].strip()
                        need_own.setdefault(name, []).append(f"{wanted} (needed by {dist.name})")
                        lines.append(wanted)
                    else:
                        lines.extend(self._missing_extras(req, target, dists, markers))
        return need_own, lines
