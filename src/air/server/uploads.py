"""Code snapshots sent to the server: content-addressed blobs, and a manifest rebuilt into a folder.

The client asks which blobs (sha256 of a file's content) the server lacks and uploads only those; the
submit then names every file of the snapshot by path, mode and blob. Everything a client sends is
checked before anything is written: a blob whose content does not hash to its name, a path that is
absolute or climbs out with '..', a link pointing out of the snapshot, too many or duplicate files.

Under AIR_HOME (this module owns these names)::

    server/blobs/<sha256>              one file's content
    server/uploads/<key>/<name>/...    a rebuilt snapshot (key: sha256 of its manifest)
    server/users/<user>/secrets.json   that user's secrets
    server/session-secret              signs the web pages' session cookies (0600; kept across restarts)
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from air.constants import SERVER_MAX_SNAPSHOT_FILES
from air.errors import UserInputError
from air.files import atomic_write_bytes
from air.home import AirHome

_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
_NAME_RE = re.compile(r"^[A-Za-z0-9_.@+-]{1,255}$")
_MODES = {"100644": 0o644, "100755": 0o755, "120000": None}


@dataclass(frozen=True)
class ServerPaths:
    """Where the server keeps what clients upload (under its AIR_HOME)."""

    root: Path

    @classmethod
    def here(cls) -> ServerPaths:
        return cls(AirHome().server)

    @property
    def blobs(self) -> Path:
        return self.root / "blobs"

    def blob(self, digest: str) -> Path:
        return self.blobs / check_digest(digest)

    @property
    def uploads(self) -> Path:
        return self.root / "uploads"

    def user_secrets(self, user: str) -> Path:
        """A user's secret store: their folder is laid out like a home of its own (`secrets.json`)."""
        return AirHome(self.root / "users" / user).secrets

    @property
    def session_secret(self) -> Path:
        return self.root / "session-secret"


def session_secret(paths: ServerPaths) -> bytes:
    """The key that signs the pages' session cookies: made once (32 random bytes, 0600) and read by every
    later start, so restarting the server does not log browsers out. Two servers starting at once on one
    home agree on it: the first to link its file in place wins, the other reads that one."""
    path = paths.session_secret
    try:
        secret = path.read_bytes()
        if len(secret) >= 32:
            return secret
    except FileNotFoundError:
        pass
    staged = atomic_write_bytes(path.with_name(f".{path.name}.{os.getpid()}"), os.urandom(32), mode=0o600)
    try:
        os.link(staged, path)  # never replaces one another server wrote meanwhile
    except FileExistsError:
        if len(path.read_bytes()) < 32:  # a broken one (cut short): replaced, atomically
            os.replace(staged, path)
    finally:
        staged.unlink(missing_ok=True)
    return path.read_bytes()


def check_digest(digest: Any) -> str:
    if not isinstance(digest, str) or not _SHA_RE.match(digest):
        raise UserInputError(f"{str(digest)[:80]!r} is not a blob name (64 lowercase hex digits of a sha256).")
    return digest


def missing_blobs(paths: ServerPaths, digests: list[str]) -> list[str]:
    """The blobs of `digests` the server does not have yet (what the client must upload)."""
    if not isinstance(digests, list) or len(digests) > SERVER_MAX_SNAPSHOT_FILES:
        raise UserInputError(f"'digests' must be a list of at most {SERVER_MAX_SNAPSHOT_FILES} blob names.")
    return sorted({d for d in digests if not paths.blob(d).exists()})


def store_blob(paths: ServerPaths, digest: str, chunks: Any) -> int:
    """Write a blob from an iterable of byte chunks; its sha256 must be its name (else nothing is kept).
    Returns its size."""
    target = paths.blob(digest)
    paths.blobs.mkdir(parents=True, exist_ok=True)
    hasher = hashlib.sha256()
    size = 0
    fd, tmp = tempfile.mkstemp(dir=paths.blobs, prefix=".upload-")
    try:
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                hasher.update(chunk)
                size += len(chunk)
                out.write(chunk)
        if hasher.hexdigest() != digest:
            raise UserInputError(f"The uploaded content hashes to {hasher.hexdigest()}, not to its name {digest}.",
                                 hint="Upload each file under the sha256 of its content.")
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return size


def _check_path(path: Any) -> str:
    if not isinstance(path, str) or not path or len(path) > 4096 or "\x00" in path or "\\" in path:
        raise UserInputError(f"Snapshot file name {str(path)[:200]!r} is not a relative path.")
    parts = path.split("/")
    if path.startswith("/") or any(p in ("", ".", "..") for p in parts) or parts[0] == ".git":
        raise UserInputError(f"Snapshot file name {path[:200]!r} is not allowed: it must stay inside the snapshot "
                             "(no absolute path, no '.', '..' or empty part, nothing under .git).")
    return path


def _check_manifest(manifest: Any) -> tuple[str, list[dict[str, Any]]]:
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), list):
        raise UserInputError("'snapshot' must be an object with 'name' and a list 'files'.")
    name = manifest.get("name")
    if not isinstance(name, str) or not _NAME_RE.match(name) or name in (".", ".."):
        raise UserInputError(f"Snapshot name {str(name)[:80]!r} is not a folder name.")
    files = manifest["files"]
    if len(files) > SERVER_MAX_SNAPSHOT_FILES:
        raise UserInputError(f"A snapshot may hold at most {SERVER_MAX_SNAPSHOT_FILES} files; this one has {len(files)}.",
                             hint="List large data in .gitignore, or narrow code_source.snapshot.include_paths.")
    seen: set[str] = set()
    for entry in files:
        if not isinstance(entry, dict):
            raise UserInputError("Each snapshot file must be an object {path, mode, sha256 | target}.")
        path = _check_path(entry.get("path"))
        if path in seen:
            raise UserInputError(f"Snapshot file {path!r} is listed twice.")
        seen.add(path)
        mode = entry.get("mode")
        if mode not in _MODES:
            raise UserInputError(f"Snapshot file {path!r}: mode {mode!r} is not one of {', '.join(_MODES)}.")
        if mode == "120000":
            target = entry.get("target")
            resolved = posixpath.normpath(posixpath.join(posixpath.dirname(path), str(target)))
            if not isinstance(target, str) or target.startswith("/") or resolved == ".." or resolved.startswith("../"):
                raise UserInputError(f"Snapshot link {path!r} points out of the snapshot ({str(target)[:200]!r}).")
        else:
            check_digest(entry.get("sha256"))
    for path in seen:  # a file cannot also be a folder of another file
        parent = posixpath.dirname(path)
        while parent:
            if parent in seen:
                raise UserInputError(f"Snapshot file {parent!r} is also the folder of {path!r}.")
            parent = posixpath.dirname(parent)
    return name, files


def build_snapshot(paths: ServerPaths, manifest: Any) -> Path:
    """The folder holding the snapshot `manifest` describes, built from blobs once (then reused). Every
    check comes first: a bad manifest or a missing blob writes nothing."""
    name, files = _check_manifest(manifest)
    lacking = sorted({f["sha256"] for f in files if f["mode"] != "120000" and not paths.blob(f["sha256"]).exists()})
    if lacking:
        raise UserInputError(f"{len(lacking)} blob(s) of the snapshot were not uploaded (first: {lacking[0]}).",
                             hint="Upload them first (POST /api/v1/blobs/missing says which).")
    canonical = json.dumps({"name": name, "files": sorted(
        ({k: f.get(k) for k in ("path", "mode", "sha256", "target")} for f in files), key=lambda f: f["path"])},
        sort_keys=True)
    key = hashlib.sha256(canonical.encode()).hexdigest()
    final = paths.uploads / key
    if (final / name).is_dir():
        return final / name
    paths.uploads.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=paths.uploads, prefix=".build-"))
    try:
        root = staging / name
        root.mkdir()
        for entry in files:
            dest = root / entry["path"]
            dest.parent.mkdir(parents=True, exist_ok=True)
            if entry["mode"] == "120000":
                os.symlink(entry["target"], dest)
                continue
            shutil.copyfile(paths.blob(entry["sha256"]), dest)  # a copy: a link would share the blob's mode
            os.chmod(dest, _MODES[entry["mode"]] or 0o644)
        try:
            os.rename(staging, final)
        except OSError:  # built meanwhile by another request: theirs is the same
            if not (final / name).is_dir():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return final / name


__all__ = ["ServerPaths", "build_snapshot", "check_digest", "missing_blobs", "session_secret", "store_blob"]
