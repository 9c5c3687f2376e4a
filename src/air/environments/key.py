"""The cache key: what decides a built environment, hashed.

* **Cached by content.** The key (`environment_key`) covers what decides the result: the base
  interpreter's path, full version and platform, the normalised dependency lines and whole-install
  options, and the content of local wheels, folders and constraint files they name. A hit is a `stat`:
  no uv, no subprocess for the default base.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from air.bounds import JSONObject
from air.environments.dependencies import (
    Dependency,
    DependencySet,
    InstallOption,
    canonical_name,
    without_hashes,
)
from air.environments.layout import SCHEMA, envs_dir
from air.errors import UserInputError
from air.files import atomic_write_text

#: Hex digits of sha256 kept in a key (128 bits). Short keys keep shebang lines and `air env list` short.
_KEY_LENGTH = 32

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

_identity_memo: dict[tuple[str, int, int], JSONObject] = {}


def interpreter_identity(python: Path) -> JSONObject:
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
    identity: JSONObject
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
        req = Requirement(without_hashes(dep.line))
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
    material: dict[str, object] = {
        "schema": SCHEMA,
        "base": str(base),
        "interpreter": interpreter_identity(base),
        "options": [[o.flag, _option_material(o, digests)] for o in deps.options],
        # Plain entries are a set (order does not change uv's answer); per-entry ones install in order.
        "dependencies": sorted(_dependency_material(d, digests, deps.snapshot) for d in deps.dependencies
                               if not d.flags),
        "installed_one_by_one": [_dependency_material(d, digests, deps.snapshot) for d in deps.dependencies
                                 if d.flags],
    }
    digests.save()
    blob = json.dumps(material, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:_KEY_LENGTH]


def _dependency_material(dep: Dependency, digests: _Digests, snapshot: Path | None = None) -> str:
    """A local wheel or folder of a server run's snapshot is named relative to the snapshot (its content is
    in the key anyway); an editable one keeps its path, which the environment points at."""
    content = digests.of_path(dep.local_path, editable=dep.editable) if dep.local_path else None
    line = _normalised(dep)
    if snapshot is not None and dep.local_path is not None and not dep.editable:
        line = line.replace(str(snapshot), "<snapshot>")
    return json.dumps([line, list(dep.flags), dep.editable, content])


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
            self._path = envs_dir(create=False) / ".digests.json"  # a dry run's lookup creates nothing
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
        if self._dirty and self._memo is not None and self._path is not None and self._path.parent.is_dir():
            if len(self._memo) > 5000:  # keep it small: drop the oldest half
                self._memo = dict(list(self._memo.items())[-2500:])
            atomic_write_text(self._path, json.dumps(self._memo))
