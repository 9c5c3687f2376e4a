"""Code snapshots sent to the server: content-addressed blobs, and a manifest rebuilt into a folder.

The client asks which blobs (sha256 of a file's content) the server lacks and uploads only those; the
submit then names every file of the snapshot by path, mode and blob. Everything a client sends is
checked before anything is written: a blob whose content does not hash to its name, a path that is
absolute or climbs out with '..', a link pointing out of the snapshot, too many or duplicate files.

Under AIR_HOME (this module owns these names)::

    server/blobs/<sha256>              one file's content
    server/uploads/<key>/<name>/...    a rebuilt snapshot (key: sha256 of its manifest)
    server/users/<user>/secrets.json   that user's secrets
    server/users/<user>/blobs.txt      the blobs that user uploaded ("<sha256> <size>" a line: their quota)
    server/server.log                  MLflow's output and the server's warnings
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
import shutil
import tempfile
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from air.constants import SERVER_MAX_SNAPSHOT_FILES
from air.errors import UserInputError
from air.home import AirHome
from air.wire import SnapshotManifest
from air.workload.snapshot_links import leaving_links

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

    @property
    def mlflow_socket(self) -> Path:
        """The Unix socket MLflow listens on (air.server.mlflow_server), in a 0700 folder of its own."""
        return self.root / "mlflow" / "mlflow.sock"

    @property
    def log(self) -> Path:
        """The server's own log: its MLflow server's output and warnings, kept out of the terminal."""
        return self.root / "server.log"

    @property
    def mlflow_credential(self) -> Path:
        """The server's own MLflow credential (0600): its supervisors' and call drivers' key to the door."""
        return self.root / "mlflow-credential"

    def user_blobs(self, user: str) -> Path:
        """The blobs `user` uploaded, one `<sha256> <size>` a line: what counts against their quota."""
        return self.root / "users" / user / "blobs.txt"

    def user_secrets(self, user: str) -> Path:
        """A user's secret store: their folder is laid out like a home of its own (`secrets.json`)."""
        return AirHome(self.root / "users" / user).secrets


def check_digest(digest: object) -> str:
    if not isinstance(digest, str) or not _SHA_RE.match(digest):
        raise UserInputError(f"{str(digest)[:80]!r} is not a blob name (64 lowercase hex digits of a sha256).")
    return digest


def missing_blobs(paths: ServerPaths, digests: list[str]) -> list[str]:
    """The blobs of `digests` the server does not have yet (what the client must upload)."""
    if len(digests) > SERVER_MAX_SNAPSHOT_FILES:
        raise UserInputError(f"'digests' must be a list of at most {SERVER_MAX_SNAPSHOT_FILES} blob names.")
    return sorted({d for d in digests if not paths.blob(d).exists()})


class BlobUpload:
    """One blob being received: each piece is hashed and written to a temporary file as it arrives, so the
    server's memory does not grow with the body; `finish` keeps it only if its sha256 is its name."""

    def __init__(self, paths: ServerPaths, digest: str) -> None:
        self.digest = check_digest(digest)
        self.target = paths.blob(digest)
        paths.blobs.mkdir(parents=True, exist_ok=True)
        self.hasher = hashlib.sha256()
        self.size = 0
        fd, tmp = tempfile.mkstemp(dir=paths.blobs, prefix=".upload-")
        self.tmp = Path(tmp)
        self.out: BinaryIO | None = os.fdopen(fd, "wb")

    def write(self, chunk: bytes) -> None:
        assert self.out is not None, "write after finish or discard"
        self.hasher.update(chunk)
        self.size += len(chunk)
        self.out.write(chunk)

    def finish(self) -> int:
        """Keep the blob under its name (atomically); its size. Refused, and nothing kept, when the content
        does not hash to the name."""
        assert self.out is not None, "finish after discard"
        self.out.close()
        self.out = None
        if self.hasher.hexdigest() != self.digest:
            self.discard()
            raise UserInputError(f"The uploaded content hashes to {self.hasher.hexdigest()}, not to its name "
                                 f"{self.digest}.", hint="Upload each file under the sha256 of its content.")
        os.replace(self.tmp, self.target)
        return self.size

    def discard(self) -> None:
        """Drop what was received (a cut connection, a body too large); harmless after finish."""
        if self.out is not None:
            self.out.close()
            self.out = None
        self.tmp.unlink(missing_ok=True)


class BlobQuotaExceeded(UserInputError):
    """A user's uploaded blobs would go past `server.limits.blob_quota_per_user`."""

    code = "BLOB_QUOTA_EXCEEDED"
    http_status = 413


class BlobQuota:
    """What one user's uploads may still take: the blobs their ledger (`ServerPaths.user_blobs`) names that
    still exist, plus what they are uploading right now, against the server's per-user quota (None: none).
    A blob is charged to the user who first uploaded it (content-addressed: others reuse it for free)."""

    _lock = threading.Lock()
    #: user → bytes being received for them now, in this server process (concurrent uploads add up).
    _receiving: dict[str, int] = {}

    def __init__(self, paths: ServerPaths, user: str, quota: int | None) -> None:
        self.paths = paths
        self.user = user
        self.quota = quota
        self.ledger = paths.user_blobs(user)
        self.taken = 0  # what this upload holds of _receiving

    def used(self) -> int:
        """Bytes of the user's blobs on the server (a blob no longer there no longer counts)."""
        sizes: dict[str, int] = {}
        try:
            text = self.ledger.read_text()
        except FileNotFoundError:
            return 0
        for line in text.splitlines():
            digest, _, size = line.partition(" ")
            if _SHA_RE.match(digest) and size.isdigit():
                sizes[digest] = int(size)
        return sum(size for digest, size in sizes.items() if self.paths.blob(digest).exists())

    def take(self, more: int) -> None:
        """Hold `more` bytes for this upload; BlobQuotaExceeded (nothing held) where that goes past the quota."""
        if self.quota is None or more <= 0:
            return
        with self._lock:
            receiving = self._receiving.get(self.user, 0)
            used = self.used()
            if used + receiving + more > self.quota:
                from air.runs.reasons import size_text

                raise BlobQuotaExceeded(
                    f"Upload refused: {self.user}'s blobs on this server would take more than their quota of "
                    f"{size_text(self.quota)} ({size_text(used)} stored, {size_text(receiving + more)} being "
                    "uploaded); nothing of this upload was kept.",
                    hint="Keep large files out of the code snapshot (.gitignore, or narrow "
                    "code_source.snapshot.include_paths) and read data on the nodes; the server's admin sets "
                    "server.limits.blob_quota_per_user.")
            self._receiving[self.user] = receiving + more
            self.taken += more

    def release(self) -> None:
        """Give back what this upload held (it was kept, and is in the ledger, or it was dropped)."""
        if not self.taken:
            return
        with self._lock:
            left = self._receiving.get(self.user, 0) - self.taken
            if left > 0:
                self._receiving[self.user] = left
            else:
                self._receiving.pop(self.user, None)
            self.taken = 0

    def charge(self, digest: str, size: int) -> None:
        """Note a blob the user uploaded (appended, one line: concurrent uploads never interleave)."""
        self.ledger.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.ledger, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, f"{digest} {size}\n".encode())
        finally:
            os.close(fd)


#: Pieces of a streamed body are gathered up to this size before a worker thread writes them.
_WRITE_BATCH = 1 << 20


async def receive_blob(paths: ServerPaths, digest: str, chunks: AsyncIterator[bytes],
                       quota: BlobQuota | None = None, declared: int | None = None) -> int:
    """Stream a request body into a blob: at most one batch (1 MiB) is held in memory at a time, hashing
    and writing happen off the event loop. Returns its size. With `quota`, a body past the user's quota
    (its declared length at once, else as it arrives) is refused with 413 and its partial file removed."""
    from starlette.concurrency import run_in_threadpool

    try:
        if quota is not None and declared is not None:
            await run_in_threadpool(quota.take, declared)  # before anything is written
        upload = await run_in_threadpool(BlobUpload, paths, digest)
    except BaseException:
        if quota is not None:
            quota.release()
        raise
    existed = upload.target.exists()
    try:
        batch = bytearray()
        async for chunk in chunks:
            batch += chunk
            if len(batch) >= _WRITE_BATCH:
                if quota is not None and upload.size + len(batch) > quota.taken:
                    await run_in_threadpool(quota.take, upload.size + len(batch) - quota.taken)
                await run_in_threadpool(upload.write, bytes(batch))
                batch.clear()
        if batch:
            if quota is not None and upload.size + len(batch) > quota.taken:
                await run_in_threadpool(quota.take, upload.size + len(batch) - quota.taken)
            await run_in_threadpool(upload.write, bytes(batch))
        size = int(await run_in_threadpool(upload.finish))
        if quota is not None and not existed:
            await run_in_threadpool(quota.charge, digest, size)
        return size
    finally:
        upload.discard()
        if quota is not None:
            quota.release()


def _check_path(path: object) -> str:
    if not isinstance(path, str) or not path or len(path) > 4096 or "\x00" in path or "\\" in path:
        raise UserInputError(f"Snapshot file name {str(path)[:200]!r} is not a relative path.")
    parts = path.split("/")
    if path.startswith("/") or any(p in ("", ".", "..") for p in parts) or parts[0] == ".git":
        raise UserInputError(f"Snapshot file name {path[:200]!r} is not allowed: it must stay inside the snapshot "
                             "(no absolute path, no '.', '..' or empty part, nothing under .git).")
    return path


def _check_manifest(manifest: SnapshotManifest) -> None:
    """What the model cannot say of a manifest (its types are the model's): names, modes, digests, links."""
    name, files = manifest.name, manifest.files
    if not _NAME_RE.match(name) or name in (".", ".."):
        raise UserInputError(f"Snapshot name {name[:80]!r} is not a folder name.")
    if len(files) > SERVER_MAX_SNAPSHOT_FILES:
        raise UserInputError(f"A snapshot may hold at most {SERVER_MAX_SNAPSHOT_FILES} files; this one has {len(files)}.",
                             hint="List large data in .gitignore, or narrow code_source.snapshot.include_paths.")
    seen: set[str] = set()
    links: dict[str, str] = {}
    for entry in files:
        path = _check_path(entry.path)
        if path in seen:
            raise UserInputError(f"Snapshot file {path!r} is listed twice.")
        seen.add(path)
        if entry.mode not in _MODES:
            raise UserInputError(f"Snapshot file {path!r}: mode {entry.mode!r} is not one of {', '.join(_MODES)}.")
        if entry.mode == "120000":
            target = entry.target
            if not target or len(target) > 4096 or "\x00" in target:
                raise UserInputError(f"Snapshot link {path!r}: its target must be a relative path, got "
                                     f"{str(target)[:200]!r}.")
            links[path] = target
        else:
            check_digest(entry.sha256)
    leaving = leaving_links(links)  # resolved against the whole tree, every link followed, not lexically
    if leaving:
        first = leaving[0]
        raise UserInputError(f"Snapshot link {first!r} points out of the snapshot ({links[first][:200]!r}, "
                             f"following the snapshot's links){f' (and {len(leaving) - 1} more)' if len(leaving) > 1 else ''}.",
                             hint="A link in a snapshot must lead to a place inside it; copy what it points to "
                             "into the snapshot, or leave the link out (.gitignore).")
    for path in seen:  # a file cannot also be a folder of another file
        parent = posixpath.dirname(path)
        while parent:
            if parent in seen:
                raise UserInputError(f"Snapshot file {parent!r} is also the folder of {path!r}.")
            parent = posixpath.dirname(parent)


def build_snapshot(paths: ServerPaths, manifest: SnapshotManifest) -> Path:
    """The folder holding the snapshot `manifest` describes, built from blobs once (then reused). Every
    check comes first: a bad manifest or a missing blob writes nothing."""
    _check_manifest(manifest)
    name, files = manifest.name, manifest.files
    lacking = sorted({str(f.sha256) for f in files if f.mode != "120000" and not paths.blob(str(f.sha256)).exists()})
    if lacking:
        raise UserInputError(f"{len(lacking)} blob(s) of the snapshot were not uploaded (first: {lacking[0]}).",
                             hint="Upload them first (POST /api/v1/blobs/missing says which).")
    canonical = json.dumps({"name": name, "files": sorted((f.model_dump() for f in files), key=lambda f: f["path"])},
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
            dest = root / entry.path
            dest.parent.mkdir(parents=True, exist_ok=True)
            if entry.mode == "120000":
                os.symlink(str(entry.target), dest)
                continue
            shutil.copyfile(paths.blob(str(entry.sha256)), dest)  # a copy: a link would share the blob's mode
            os.chmod(dest, _MODES[entry.mode] or 0o644)
        try:
            os.rename(staging, final)
        except OSError:  # built meanwhile by another request: theirs is the same
            if not (final / name).is_dir():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return final / name

