"""`environment.dependencies` as virtual environments made with uv, layered on a base interpreter, cached.

Why it looks the way it does:

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
* **Cached by content.** The key (`environment_key`) covers what decides the result: the base
  interpreter's path, full version and platform, the normalised dependency lines and whole-install
  options, and the content of local wheels, folders and constraint files they name. A hit is a `stat`:
  no uv, no subprocess for the default base.
* **Built in place under a lock.** A venv holds absolute paths (script shebangs), so it is built at its
  final path `$AIR_HOME/envs/<key>/` while holding an exclusive `flock` on `envs/.locks/<key>.lock`, and
  the marker `.air-complete` is written last. Readers trust only the marker; a process that finds no
  marker takes the lock, so it waits for a running build and never builds twice. A failed or interrupted
  build is removed before the lock is released. `use_environment` holds a shared lock for as long as a
  node runs, and `prune_environments` only removes what it can lock exclusively.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal
from urllib.parse import unquote, urlparse

from air.errors import EnvironmentBuildError, UserInputError
from air.home import air_home

#: Bump when the folder layout or the key material changes: old entries then simply stop matching.
_SCHEMA = 1

#: Hex digits of sha256 kept in a key (128 bits). Short keys keep shebang lines and `air env list` short.
_KEY_LENGTH = 32

#: At most this many install rounds while working out which base packages need another version.
_MAX_INSTALL_ROUNDS = 5

# Files inside an environment folder, beside the venv's own bin/, lib/, pyvenv.cfg.
_COMPLETE = ".air-complete"  # written last: the environment is ready
_LAST_USED = ".air-last-used"  # mtime = last time a run used it
_META = "air-env.json"  # what it was built from
_REQUIREMENTS = "air-requirements.txt"  # what uv was asked to install
_EXCLUDES = "air-excludes.txt"  # base packages uv was told to leave alone (as overrides)
_LAYER_PTH = "_air_base_layer.pth"  # puts the base interpreter's site folders behind ours

CacheState = Literal["cached", "will build"]
Log = Callable[[str], None]


# ---- dependency lines -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Dependency:
    """One install entry: a requirement, a local wheel/archive/folder, or a URL.

    `line` is what uv gets (variables expanded, local paths absolute); `display` is what the user wrote,
    so expanded secrets (an index token) never reach logs, messages or metadata.
    """

    line: str
    display: str
    name: str | None = None  # canonical project name, when the line names one
    local_path: Path | None = None
    editable: bool = False
    url: bool = False
    flags: tuple[str, ...] = ()  # uv flags for this entry alone (--no-deps, …): installed on its own


@dataclass(frozen=True)
class InstallOption:
    """A line that applies to the whole install: an index, find-links, a constraints file, --no-index."""

    flag: str  # the uv flag
    value: str | None
    display: str
    local_path: Path | None = None


@dataclass(frozen=True)
class DependencySet:
    """Parsed `environment.dependencies`: entries, whole-install options, and where they came from."""

    dependencies: tuple[Dependency, ...] = ()
    options: tuple[InstallOption, ...] = ()
    source: Path | None = None  # the requirements file, when one was named
    version: str | int | None = None  # `version:` of the requirements.yaml form
    warnings: tuple[str, ...] = ()

    @property
    def is_empty(self) -> bool:
        """Nothing to install: the run can use the base interpreter as it is."""
        return not self.dependencies

    def lines(self) -> list[str]:
        """The lines as the user wrote them (options first), for logs, `--dry-run` and `air env list`."""
        return [o.display for o in self.options] + [d.display for d in self.dependencies]


_URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://|^git\+")
_NAME_RE = re.compile(r"^\s*([A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)\s*(?=\[|[<>=!~;@(\s]|$)")
_VAR_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)")
_ARCHIVE_SUFFIXES = (".whl", ".tar.gz", ".zip", ".tar.bz2", ".tgz", ".tar")

# Option spelling → (uv flag, takes a value). Whole-install options apply to every entry (as in pip).
_WHOLE_INSTALL: dict[str, tuple[str, bool]] = {
    "--index-url": ("--index-url", True),
    "-i": ("--index-url", True),
    "--extra-index-url": ("--extra-index-url", True),
    "--find-links": ("--find-links", True),
    "-f": ("--find-links", True),
    "--no-index": ("--no-index", False),
    "--constraint": ("--constraints", True),
    "-c": ("--constraints", True),
    "--trusted-host": ("--allow-insecure-host", True),
    "--pre": ("--prerelease=allow", False),
}
# Scoped options: apply to the next entry only, which is then installed on its own (as the reference).
_PER_ENTRY: dict[str, str] = {
    "--no-deps": "--no-deps",
    "--no-build-isolation": "--no-build-isolation",
    "--force-reinstall": "--reinstall",
    "--no-cache-dir": "--no-cache",
    "--upgrade": "--upgrade",
    "-U": "--upgrade",
}
_INCLUDE = ("-r", "--requirement")
_EDITABLE = ("-e", "--editable")


def canonical_name(name: str) -> str:
    """PEP 503 normalised project name (`Foo_Bar` → `foo-bar`)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_dependencies(dependencies: list[str] | str | Path | None, base_dir: Path) -> DependencySet:
    """Parse an inline list, or a requirements file (`.txt`, or the `{version, dependencies}` YAML form).

    Relative paths resolve against `base_dir` (the workload YAML's folder) or, inside a file, against that
    file's folder. Every problem is a UserInputError naming the line; nothing is installed here.
    """
    parser = _Parser()
    if dependencies is None:
        return DependencySet()
    if isinstance(dependencies, (str, Path)):
        source = _resolve_path(os.fspath(dependencies), base_dir, "environment.dependencies")
        if not source.is_file():
            raise UserInputError(
                f"environment.dependencies names {source}, which is not a file.",
                hint="Give a path to a requirements.txt or requirements.yaml (relative to the workload YAML), "
                "or an inline list of packages.",
            )
        version: str | int | None = None
        if source.suffix in (".yaml", ".yml"):
            version, lines = _read_yaml_requirements(source)
            parser.add_lines(lines, source.parent, origin=f"{source}: dependencies", inline=True)
        else:
            parser.add_file(source, origin="environment.dependencies")
        return parser.result(source=source, version=version)
    if isinstance(dependencies, (list, tuple)):
        bad = [item for item in dependencies if not isinstance(item, str)]
        if bad:
            raise UserInputError(
                f"environment.dependencies entries must be strings, got {bad[0]!r}.",
                hint="Quote version-like entries in YAML, e.g. - \"numpy==1.26\".",
            )
        parser.add_lines(list(dependencies), base_dir, origin="environment.dependencies", inline=True)
        return parser.result(source=None, version=None)
    raise UserInputError(
        f"environment.dependencies must be a list of packages or a path to a requirements file, "
        f"got {type(dependencies).__name__}."
    )


def _read_yaml_requirements(path: Path) -> tuple[str | int | None, list[str]]:
    import yaml  # only for this form: keep it off the cache-hit path

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise UserInputError(f"Cannot read requirements file {path}: {exc}") from None
    if data is None:
        return None, []
    if not isinstance(data, dict):
        raise UserInputError(f"{path} must be a mapping with `dependencies` (and optionally `version`).")
    unknown = sorted(set(data) - {"version", "dependencies"})
    if unknown:
        raise UserInputError(f"{path}: unknown key(s) {', '.join(map(repr, unknown))}; allowed: version, dependencies.")
    lines = data.get("dependencies") or []
    if not isinstance(lines, list) or not all(isinstance(x, str) for x in lines):
        raise UserInputError(f"{path}: `dependencies` must be a list of strings.")
    version = data.get("version")
    if version is not None and not isinstance(version, (str, int)):
        raise UserInputError(f"{path}: `version` must be a string or an integer.")
    return version, lines


def _resolve_path(text: str, base_dir: Path, origin: str) -> Path:
    path = Path(os.path.expanduser(_expand_vars(text, origin)))
    return Path(os.path.abspath(path if path.is_absolute() else base_dir / path))


def _expand_vars(text: str, origin: str) -> str:
    """`$VAR` and `${VAR}` from the environment; an unset variable is an error, not a literal `$VAR`."""

    def repl(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in os.environ:
            raise UserInputError(
                f"{origin}: {text!r} uses ${name}, which is not set.",
                hint=f"Set {name} in the environment that runs air, or write the value out.",
            )
        return os.environ[name]

    return _VAR_RE.sub(repl, text)


class _Parser:
    """Accumulates entries and options across an inline list and the files it includes."""

    def __init__(self) -> None:
        self.dependencies: list[Dependency] = []
        self.options: list[InstallOption] = []
        self.warnings: list[str] = []
        self._pending_flags: list[str] = []
        self._files: list[Path] = []

    def result(self, *, source: Path | None, version: str | int | None) -> DependencySet:
        if self._pending_flags:
            raise UserInputError(f"{' '.join(self._pending_flags)} at the end of the dependencies applies to nothing.")
        index_urls = [o for o in self.options if o.flag == "--index-url"]
        if len({o.value for o in index_urls}) > 1:
            self.warnings.append(f"several --index-url lines; the last one ({index_urls[-1].display}) is used")
            self.options = [o for o in self.options if o.flag != "--index-url" or o is index_urls[-1]]
        seen: set[tuple[str, str | None]] = set()
        options = []
        for opt in self.options:
            if (opt.flag, opt.value) not in seen:
                seen.add((opt.flag, opt.value))
                options.append(opt)
        return DependencySet(tuple(self.dependencies), tuple(options), source, version, tuple(self.warnings))

    def add_file(self, path: Path, origin: str) -> None:
        if path in self._files:
            raise UserInputError(f"{origin}: requirements file {path} includes itself (via -r).")
        if not path.is_file():
            raise UserInputError(f"{origin}: requirements file {path} does not exist.")
        self._files.append(path)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UserInputError(f"Cannot read requirements file {path}: {exc}") from None
        self.add_lines(_join_continuations(text.splitlines()), path.parent, origin=str(path))
        self._files.pop()

    def add_lines(self, lines: Iterable[str], base_dir: Path, origin: str, *, inline: bool = False) -> None:
        """Add lines of a file (`origin` is its path) or of an inline list (`inline`: entries are numbered)."""
        for number, raw in enumerate(lines, start=1):
            text = re.sub(r"(^|\s)#.*$", "", raw).strip()
            if text:
                self._add_line(text, base_dir, f"{origin}[{number - 1}]" if inline else f"{origin}, line {number}")

    def _add_line(self, text: str, base_dir: Path, where: str) -> None:
        display = text
        while text.startswith("-"):
            head, *tail = text.split(None, 1)
            flag, eq, value = head.partition("=")
            rest = tail[0].strip() if tail else ""
            if flag in _PER_ENTRY:
                self._pending_flags.append(_PER_ENTRY[flag])
                text = rest
                if not text:
                    return
                continue
            if flag in _WHOLE_INSTALL or flag in _INCLUDE or flag in _EDITABLE:
                takes_value = flag in _INCLUDE or flag in _EDITABLE or _WHOLE_INSTALL[flag][1]
                if takes_value and not eq:
                    value, rest = rest, ""
                if takes_value and not value:
                    raise UserInputError(f"{where}: {flag} needs a value.")
                if rest:
                    raise UserInputError(f"{where}: unexpected text after {flag} {value}: {rest!r}.")
                if flag in _INCLUDE:
                    self.add_file(_resolve_path(value, base_dir, where), origin=where)
                elif flag in _EDITABLE:
                    path = _resolve_path(value, base_dir, where)
                    if not path.is_dir():
                        raise UserInputError(f"{where}: editable {value!r} names {path}, which is not a folder.")
                    self._add_dependency(Dependency(
                        line=f"-e {path}", display=display, name=_local_name(path), local_path=path, editable=True
                    ))
                else:
                    self._add_option(_WHOLE_INSTALL[flag][0], value if takes_value else None, display, base_dir, where)
                return
            raise UserInputError(
                f"{where}: unsupported option {flag!r}.",
                hint="Supported: --index-url/-i, --extra-index-url, --find-links/-f, --no-index, --constraint/-c, "
                "--trusted-host, --pre, -r FILE, -e PATH, and per entry --no-deps, --no-build-isolation, "
                "--force-reinstall, --no-cache-dir, --upgrade.",
            )
        self._add_dependency(_parse_entry(text, display, base_dir, where))

    def _add_option(self, flag: str, value: str | None, display: str, base_dir: Path, where: str) -> None:
        local: Path | None = None
        if value is not None:
            value = _expand_vars(value, where)
            if flag in ("--find-links", "--constraints") and not _URL_RE.match(value):
                local = _resolve_path(value, base_dir, where)
                if not local.exists():
                    raise UserInputError(f"{where}: {display!r} names {local}, which does not exist.")
                value = str(local)
        self.options.append(InstallOption(flag, value, display, local))

    def _add_dependency(self, dep: Dependency) -> None:
        if self._pending_flags:
            dep = dataclasses.replace(dep, flags=tuple(self._pending_flags) + dep.flags)
            self._pending_flags = []
        self.dependencies.append(dep)


def _join_continuations(lines: list[str]) -> list[str]:
    """requirements.txt lines ending in a backslash continue on the next line."""
    out: list[str] = []
    buffer = ""
    for line in lines:
        if line.endswith("\\"):
            buffer += (line[:-1].strip() if buffer else line[:-1].rstrip()) + " "
            continue
        out.append(buffer + line.lstrip() if buffer else line)
        buffer = ""
    if buffer:
        out.append(buffer)
    return out


def _parse_entry(text: str, display: str, base_dir: Path, where: str) -> Dependency:
    line = _expand_vars(text, where)
    requirement = re.split(r"\s+--hash[= ]", line, maxsplit=1)[0].strip()
    if _URL_RE.match(requirement):
        local = _file_url_path(requirement)
        if local is not None and not local.exists():
            raise UserInputError(f"{where}: {display!r} names {local}, which does not exist.")
        return Dependency(line, display, name=None, local_path=local, url=local is None)
    match = _NAME_RE.match(requirement)
    direct = re.match(r"[^;@]*@\s*(\S+)", requirement) if match else None
    if match and direct:  # `name @ url`
        local = _file_url_path(direct.group(1))
        if local is not None and not local.exists():
            raise UserInputError(f"{where}: {display!r} names {local}, which does not exist.")
        return Dependency(line, display, name=canonical_name(match.group(1)), local_path=local, url=local is None)
    if _looks_like_path(requirement):
        path = _resolve_path(requirement, base_dir, where)
        if not path.exists():
            raise UserInputError(
                f"{where}: dependency {display!r} names {path}, which does not exist.",
                hint="Local wheels and folders resolve against the file that names them.",
            )
        return Dependency(str(path), display, name=_local_name(path), local_path=path)
    if not match:
        raise UserInputError(f"{where}: {display!r} is not a requirement, a path or a URL.")
    return Dependency(line, display, name=canonical_name(match.group(1)))


def _looks_like_path(text: str) -> bool:
    return (
        "/" in text or os.sep in text or text.startswith((".", "~"))
        or text.lower().endswith(_ARCHIVE_SUFFIXES)
    )


def _file_url_path(url: str) -> Path | None:
    if not url.startswith("file:"):
        return None
    return Path(unquote(urlparse(url).path))


def _local_name(path: Path) -> str | None:
    """The project name a local wheel, archive or folder installs (so it is never excluded)."""
    filename = path.name
    if filename.endswith(".whl"):
        return canonical_name(filename.split("-")[0])
    for suffix in _ARCHIVE_SUFFIXES:
        if filename.lower().endswith(suffix):
            return canonical_name(filename[: -len(suffix)].rsplit("-", 1)[0])
    if path.is_dir():
        pyproject = path / "pyproject.toml"
        if pyproject.is_file():
            match = re.search(r'(?ms)^\[project\].*?^name\s*=\s*["\']([^"\']+)', pyproject.read_text(errors="replace"))
            if match:
                return canonical_name(match.group(1))
        setup_cfg = path / "setup.cfg"
        if setup_cfg.is_file():
            match = re.search(r"(?ms)^\[metadata\].*?^name\s*=\s*(\S+)", setup_cfg.read_text(errors="replace"))
            if match:
                return canonical_name(match.group(1))
    return None


# ---- the cache key --------------------------------------------------------------------------------

_IDENTITY_SOURCE = r"""
def identity():
    import os, platform, sys, sysconfig
    try:
        libc = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (AttributeError, ValueError, OSError):
        libc = ""
    return {
        "version": sys.version, "hexversion": sys.hexversion, "implementation": sys.implementation.name,
        "cache_tag": sys.implementation.cache_tag, "platform": sysconfig.get_platform(),
        "machine": platform.machine(), "soabi": sysconfig.get_config_var("SOABI") or "", "libc": libc,
    }
"""

_identity_memo: dict[tuple[str, int, int], dict[str, Any]] = {}


def _interpreter_identity(python: Path) -> dict[str, Any]:
    """Full version and platform of `python`: in process when it is our own interpreter, else probed once."""
    try:
        st = python.stat()
    except OSError:
        raise UserInputError(
            f"The base interpreter {python} does not exist.",
            hint="Check environment.version and the `environments:` section of the air configuration.",
        ) from None
    memo_key = (os.path.realpath(python), st.st_mtime_ns, st.st_size)
    if memo_key in _identity_memo:
        return _identity_memo[memo_key]
    identity: dict[str, Any]
    if memo_key[0] == os.path.realpath(sys.executable):
        scope: dict[str, Any] = {}
        exec(_IDENTITY_SOURCE, scope)  # the same interpreter binary gives the same answer, without a subprocess
        identity = scope["identity"]()
    else:
        script = _IDENTITY_SOURCE + "\nimport json\nprint(json.dumps(identity()))\n"
        try:
            out = subprocess.run(
                [str(python), "-I", "-S", "-c", script], capture_output=True, text=True, timeout=60, check=True,
            ).stdout
            identity = json.loads(out)
        except (OSError, subprocess.SubprocessError, json.JSONDecodeError) as exc:
            raise UserInputError(f"The base interpreter {python} could not be run: {exc}") from None
    _identity_memo[memo_key] = identity
    return identity


def _normalised(dep: Dependency) -> str:
    """A requirement as the key sees it: `Foo_Bar >= 1.0` and `foo-bar>=1.0` are the same line."""
    if dep.name is None or dep.local_path is not None or dep.url:
        return " ".join(dep.line.split())
    try:
        from packaging.requirements import InvalidRequirement, Requirement
    except ImportError:  # pragma: no cover - packaging ships with pip/setuptools/mlflow
        return " ".join(dep.line.split()).lower()
    try:
        req = Requirement(re.split(r"\s+--hash[= ]", dep.line, maxsplit=1)[0])
    except InvalidRequirement:
        return " ".join(dep.line.split())
    text = canonical_name(req.name)
    if req.extras:
        text += "[" + ",".join(sorted(canonical_name(e) for e in req.extras)) + "]"
    text += ",".join(sorted(str(s) for s in req.specifier))
    if req.marker:
        text += f"; {req.marker}"
    hashes = sorted(re.findall(r"--hash[= ](\S+)", dep.line))
    return text + "".join(f" --hash={h}" for h in hashes)


def _strip_credentials(url: str) -> str:
    """Index credentials do not change what gets installed; a rotated token must not rebuild everything."""
    return re.sub(r"(?<=://)[^/@\s]+@", "", url)


def environment_key(deps: DependencySet, base_python: Path | str) -> str:
    """sha256 over everything that decides the built environment (and nothing that does not)."""
    base = Path(os.path.abspath(base_python))
    digests = _Digests()
    material: dict[str, Any] = {
        "schema": _SCHEMA,
        "base": str(base),
        "interpreter": _interpreter_identity(base),
        "options": [[o.flag, _option_material(o, digests)] for o in deps.options],
        # Plain entries are a set (order does not change uv's answer); per-entry ones install in order.
        "dependencies": sorted(_dependency_material(d, digests) for d in deps.dependencies if not d.flags),
        "installed_one_by_one": [_dependency_material(d, digests) for d in deps.dependencies if d.flags],
    }
    digests.save()
    blob = json.dumps(material, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:_KEY_LENGTH]


def _dependency_material(dep: Dependency, digests: _Digests) -> str:
    content = digests.of_path(dep.local_path, editable=dep.editable) if dep.local_path else None
    return json.dumps([_normalised(dep), list(dep.flags), dep.editable, content])


def _option_material(option: InstallOption, digests: _Digests) -> str | None:
    if option.local_path is not None:
        if option.flag == "--find-links":
            return _Digests.of_find_links(option.local_path)
        return digests.of_path(option.local_path)
    return _strip_credentials(option.value) if option.value is not None else None


_SKIP_DIRS = frozenset({
    ".git", ".hg", ".svn", "__pycache__", ".mypy_cache", ".pytest_cache", ".ruff_cache", ".tox", ".nox",
    ".venv", "venv", "node_modules", "build", "dist", ".eggs",
})
_BUILD_FILES = ("pyproject.toml", "setup.py", "setup.cfg")


def _tree_files(path: Path) -> list[tuple[str, Path]]:
    """The files of a source folder that can change what it builds, in a stable order."""
    found = []
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.endswith(".egg-info"))
        for name in sorted(files):
            full = Path(root, name)
            if not name.endswith((".pyc", ".pyo")) and (full.is_symlink() or full.is_file()):
                found.append((full.relative_to(path).as_posix(), full))
    return found


class _Digests:
    """Content hashes of local files and folders, remembered by their `stat` (path, size, mtime, inode) so
    a hit does not re-read a large wheel or a source tree. The memo lives in `envs/.digests.json`;
    losing it only costs a re-read."""

    def __init__(self) -> None:
        self._path: Path | None = None
        self._memo: dict[str, str] | None = None
        self._dirty = False

    def _load(self) -> dict[str, str]:
        if self._memo is None:
            self._path = envs_dir() / ".digests.json"
            try:
                self._memo = json.loads(self._path.read_text())
            except (OSError, ValueError):
                self._memo = {}
        return self._memo

    def of_file(self, path: Path, *, remember: bool = True) -> str:
        st = path.stat()
        memo_key = f"{path}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"
        memo = self._load() if remember else {}
        if memo_key not in memo:
            sha = hashlib.sha256()
            with path.open("rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    sha.update(chunk)
            if not remember:
                return sha.hexdigest()
            memo[memo_key] = sha.hexdigest()
            self._dirty = True
        return memo[memo_key]

    def of_path(self, path: Path | None, *, editable: bool = False) -> str | None:
        """A file's content hash; a folder's hash over its files (an editable folder: its build files only,
        since its code is read live)."""
        if path is None:
            return None
        if path.is_file():
            return self.of_file(path)
        sha = hashlib.sha256()
        if editable:
            for name in _BUILD_FILES:
                if (path / name).is_file():
                    sha.update(f"{name}\0{self.of_file(path / name)}\0".encode())
            return sha.hexdigest()
        files = _tree_files(path)
        signature = hashlib.sha256()  # stat only: when nothing changed, the remembered digest is reused
        for rel, full in files:
            st = full.lstat()
            signature.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\0".encode())
        memo_key = f"dir|{path}|{signature.hexdigest()}"
        memo = self._load()
        if memo_key not in memo:
            for rel, full in files:
                if full.is_symlink():
                    sha.update(f"{rel}\0link:{os.readlink(full)}\0".encode())
                else:
                    sha.update(f"{rel}\0{self.of_file(full, remember=False)}\0".encode())
            memo[memo_key] = sha.hexdigest()
            self._dirty = True
        return memo[memo_key]

    @staticmethod
    def of_find_links(path: Path) -> str:
        """A wheelhouse is named by what it offers: its file names and sizes (it may be large)."""
        if path.is_file():
            return f"{path.name}:{path.stat().st_size}"
        entries = sorted((e.name, e.stat().st_size) for e in os.scandir(path) if e.is_file())
        return hashlib.sha256(json.dumps(entries).encode()).hexdigest()

    def save(self) -> None:
        if self._dirty and self._memo is not None and self._path is not None:
            if len(self._memo) > 5000:  # keep it small: drop the oldest half
                self._memo = dict(list(self._memo.items())[-2500:])
            _atomic_write(self._path, json.dumps(self._memo))


# ---- the cache ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Environment:
    """A ready environment: run `python`, or put `bin_dir` first on PATH (see `activation_env`)."""

    path: Path
    bin_dir: Path
    python: Path
    key: str
    cache_hit: bool


@dataclass(frozen=True)
class EnvInfo:
    """One cache entry, for `air env list` and `air env prune`."""

    key: str
    path: Path
    size_bytes: int
    created: datetime | None
    last_used: datetime | None
    dependencies: list[str] = field(default_factory=list)
    base_python: str | None = None
    state: Literal["ready", "building", "incomplete"] = "ready"
    in_use: bool = False


def envs_dir() -> Path:
    """`$AIR_HOME/envs`, where environments live (one folder per key)."""
    path = air_home() / "envs"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _env_for(key: str, cache_hit: bool) -> Environment:
    path = envs_dir() / key
    return Environment(path=path, bin_dir=path / "bin", python=path / "bin" / "python", key=key, cache_hit=cache_hit)


def _is_complete(path: Path) -> bool:
    return (path / _COMPLETE).is_file()


def _touch_last_used(path: Path) -> None:
    marker = path / _LAST_USED
    try:
        os.utime(marker)
    except FileNotFoundError:
        with contextlib.suppress(OSError):
            marker.touch()
    except OSError:
        pass


def cache_state(deps: DependencySet, base_python: Path | str) -> CacheState:
    """What `--dry-run` reports: is the environment for these dependencies ready, or would a run build it?"""
    return "cached" if _is_complete(envs_dir() / environment_key(deps, base_python)) else "will build"


class _Lock:
    """An flock on `envs/.locks/<key>.lock`: exclusive to build or remove, shared while a node uses it.

    The lock file may be unlinked by `prune` while it holds the lock; a process that then gets the lock
    on the stale file notices (the path no longer names its inode) and opens the file again.
    """

    def __init__(self, key: str) -> None:
        folder = envs_dir() / ".locks"
        folder.mkdir(exist_ok=True)
        self.path = folder / f"{key}.lock"
        self.fd: int | None = None

    def acquire(self, mode: int, *, blocking: bool = True, on_wait: Callable[[], None] | None = None) -> bool:
        """Take the lock (LOCK_EX or LOCK_SH); `on_wait` is called once if someone else has it first."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK) or not blocking:
                    os.close(fd)
                    if not blocking and exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                        return False
                    raise
                if on_wait is not None:
                    on_wait()
                try:
                    fcntl.flock(fd, mode)
                except BaseException:
                    os.close(fd)
                    raise
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self.fd = fd
                return True
            os.close(fd)  # pruned under us: lock the new file instead

    def convert(self, mode: int) -> None:
        assert self.fd is not None
        fcntl.flock(self.fd, mode)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def ensure_environment(deps: DependencySet, base_python: Path | str, *, log: Log) -> Environment:
    """The environment for `deps` on `base_python`, built with uv unless it is cached.

    Every installer line goes to `log`. Raises EnvironmentBuildError (and leaves nothing behind) when the
    dependencies cannot be installed. To keep `air env prune` away while a node runs, use
    `use_environment` instead.
    """
    env, lock = _acquire(deps, base_python, log, hold=False)
    if lock is not None:
        lock.release()
    return env


@contextlib.contextmanager
def use_environment(deps: DependencySet, base_python: Path | str, *, log: Log) -> Iterator[Environment]:
    """`ensure_environment`, holding a shared lock on it for the `with` block so that it is not pruned."""
    env, lock = _acquire(deps, base_python, log, hold=True)
    try:
        yield env
    finally:
        if lock is not None:
            lock.release()


def _acquire(deps: DependencySet, base_python: Path | str, log: Log, *, hold: bool) -> tuple[Environment, _Lock | None]:
    """Find or build the environment. Waiting is done with a shared lock, which is granted as soon as no
    one builds or prunes, even while runs hold the environment; only a builder asks for the exclusive one."""
    base = Path(os.path.abspath(base_python))
    key = environment_key(deps, base)
    path = envs_dir() / key
    if not hold and _is_complete(path):  # the hot path: one stat, one utime
        _touch_last_used(path)
        return _env_for(key, cache_hit=True), None
    waited: list[bool] = []

    def on_wait() -> None:
        if not waited:
            log(f"air: waiting for another run that is building environment {key} …")
            waited.append(True)

    while True:
        lock = _Lock(key)
        lock.acquire(fcntl.LOCK_SH, on_wait=on_wait)
        if _is_complete(path):
            _touch_last_used(path)
            if waited:
                log(f"air: environment {key} is ready (built by another run)")
            if hold:
                return _env_for(key, cache_hit=True), lock
            lock.release()
            return _env_for(key, cache_hit=True), None
        lock.release()
        if not lock.acquire(fcntl.LOCK_EX, blocking=False):
            time.sleep(0.01)  # someone else got there first: wait for them with the shared lock
            continue
        try:
            built = not _is_complete(path)  # complete: built by another run between our two locks
            if built:
                _build(deps, base, key, path, log)
            _touch_last_used(path)
            if not hold:
                lock.release()
                return _env_for(key, cache_hit=not built), None
            lock.convert(fcntl.LOCK_SH)  # not atomic: make sure nobody pruned it in between
            if _is_complete(path):
                return _env_for(key, cache_hit=not built), lock
        except BaseException:
            lock.release()
            raise
        lock.release()


# ---- building -------------------------------------------------------------------------------------


def _build(deps: DependencySet, base: Path, key: str, path: Path, log: Log) -> None:
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
            "schema": _SCHEMA,
            "base_python": str(base),
            "base_version": _interpreter_identity(base)["version"],
            "dependencies": deps.lines(),
            "source": str(deps.source) if deps.source else None,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "build_seconds": round(time.monotonic() - started, 3),
            "satisfied_by_base": satisfied,
            "excluded_from_base": excluded,
        }
        _atomic_write(path / _META, json.dumps(meta, indent=2))
        _atomic_write(path / _COMPLETE, key)
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    log(f"air: environment {key} ready in {time.monotonic() - started:.1f}s")


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
    err.installer_error = detail  # type: ignore[attr-defined]
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
    (site_packages / _LAYER_PTH).write_text(pth + "\n")
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
        (path / _EXCLUDES).write_text("".join(f"{name} ; python_version < '0'\n" for name in sorted(excluded)))
        requirements = [d.line for d in plain if d.name is None or d.name not in excluded] + sorted(set(extra_lines))
        (path / _REQUIREMENTS).write_text("".join(f"{line}\n" for line in requirements))
        common = [uv, "pip", "install", "--python", str(path / "bin" / "python"), *options,
                  *(rebuild if round_number == 0 else []), "--overrides", str(path / _EXCLUDES)]
        if requirements:
            _run([*common, "-r", str(path / _REQUIREMENTS)], log, deps, what="install the dependencies",
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

    def __init__(self, requirement: Any, invalid: type[Exception]) -> None:
        self._requirement = requirement
        self._invalid = invalid

    @classmethod
    def create(cls) -> _Checker | None:
        try:
            from packaging.requirements import InvalidRequirement, Requirement
        except ImportError:  # pragma: no cover
            return None
        return cls(Requirement, InvalidRequirement)

    def _parse(self, text: str) -> Any | None:
        try:
            return self._requirement(re.split(r"\s+--hash[= ]", text, maxsplit=1)[0])
        except self._invalid:
            return None

    def _applies(self, req: Any, markers: dict[str, str], extra: str = "") -> bool:
        return req.marker is None or req.marker.evaluate({**markers, "extra": extra})

    def _version_ok(self, req: Any, dist: _Dist) -> bool:
        return bool(req.specifier.contains(dist.version, prereleases=True))

    def _missing_extras(self, req: Any, dist: _Dist, dists: dict[str, _Dist], markers: dict[str, str]) -> list[str]:
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


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ---- listing and pruning ---------------------------------------------------------------------------


def _folder_size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


def _mtime(path: Path) -> datetime | None:
    try:
        return datetime.fromtimestamp(path.stat().st_mtime, tz=timezone.utc)
    except OSError:
        return None


def _info(path: Path, state: Literal["ready", "building", "incomplete"], in_use: bool) -> EnvInfo:
    try:
        meta = json.loads((path / _META).read_text())
    except (OSError, ValueError):
        meta = {}
    created = meta.get("created")
    return EnvInfo(
        key=path.name,
        path=path,
        size_bytes=_folder_size(path),
        created=datetime.fromisoformat(created) if created else _mtime(path),
        last_used=_mtime(path / _LAST_USED) or _mtime(path / _COMPLETE),
        dependencies=list(meta.get("dependencies", [])),
        base_python=meta.get("base_python"),
        state=state,
        in_use=in_use,
    )


def _entries() -> list[Path]:
    return sorted(p for p in envs_dir().iterdir() if p.is_dir() and not p.name.startswith("."))


def list_environments() -> list[EnvInfo]:
    """Every cached environment, most recently used first; `in_use` is true while a run holds it."""
    infos = []
    for path in _entries():
        lock = _Lock(path.name)
        free = lock.acquire(fcntl.LOCK_EX, blocking=False)
        lock.release()
        complete = _is_complete(path)
        state: Literal["ready", "building", "incomplete"] = (
            "ready" if complete else "incomplete" if free else "building"
        )
        infos.append(_info(path, state, in_use=complete and not free))
    epoch = datetime.fromtimestamp(0, tz=timezone.utc)
    return sorted(infos, key=lambda i: i.last_used or i.created or epoch, reverse=True)


def prune_environments(older_than_days: float | None = None, all_unused: bool = False) -> list[EnvInfo]:
    """Remove environments not used for `older_than_days`, or every one not in use (`all_unused`).

    Leftovers of interrupted builds are always removed. An environment being built or used by a run is
    never touched: removal needs its exclusive lock.
    """
    if older_than_days is not None and older_than_days < 0:
        raise UserInputError(f"older_than_days must be >= 0, got {older_than_days}.")
    cutoff = time.time() - older_than_days * 86400 if older_than_days is not None else None
    removed = []
    for path in _entries():
        lock = _Lock(path.name)
        if not lock.acquire(fcntl.LOCK_EX, blocking=False):
            continue  # being built, or held by a running node
        try:
            complete = _is_complete(path)
            last_used = (path / _LAST_USED) if (path / _LAST_USED).exists() else (path / _COMPLETE)
            stale = cutoff is not None and (not last_used.exists() or last_used.stat().st_mtime < cutoff)
            if not complete or all_unused or stale:
                info = _info(path, "ready" if complete else "incomplete", in_use=False)
                with contextlib.suppress(FileNotFoundError):
                    (path / _COMPLETE).unlink()  # first: a reader never trusts a half-removed folder
                shutil.rmtree(path, ignore_errors=True)
                with contextlib.suppress(FileNotFoundError):
                    lock.path.unlink()
                removed.append(info)
        finally:
            lock.release()
    return removed


# ---- running with it --------------------------------------------------------------------------------


def activation_env(env: Environment, base_env: dict[str, str]) -> dict[str, str]:
    """`base_env` changed so that a node's command runs with `env` first on PATH (like `activate`)."""
    result = dict(base_env)
    bin_dir = str(env.bin_dir)
    rest = [p for p in result.get("PATH", os.defpath).split(os.pathsep) if p and p != bin_dir]
    result["PATH"] = os.pathsep.join([bin_dir, *rest])
    result["VIRTUAL_ENV"] = str(env.path)
    result.pop("PYTHONHOME", None)
    result.pop("__PYVENV_LAUNCHER__", None)
    return result


__all__ = [
    "CacheState",
    "Dependency",
    "DependencySet",
    "EnvInfo",
    "Environment",
    "InstallOption",
    "activation_env",
    "cache_state",
    "canonical_name",
    "ensure_environment",
    "environment_key",
    "envs_dir",
    "list_environments",
    "parse_dependencies",
    "prune_environments",
    "use_environment",
]
