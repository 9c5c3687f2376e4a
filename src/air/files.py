"""Atomic file writes: the one helper every file air writes for others to read goes through; and the one
reader of files another account could have written (`read_own_file`)."""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path


def atomic_write_bytes(path: Path | str, data: bytes | Iterable[bytes], *, mode: int = 0o644, durable: bool = True,
                       check: Callable[[Path], object] | None = None) -> Path:
    """Write `data` (or its chunks, streamed) so readers see the old file or the new one, never a mix: tmp
    file + fsync + rename.

    Creates missing parent folders. `mode` is the final permission (0o600 for anything secret, 0o755 for
    a script). `durable=False` skips the fsync, for scratch files that matter only while the processes
    that share them live (a call's payload, rank outcomes): atomic still, and off the call's latency.
    `check(tmp)` may refuse the written file (raise) before it replaces the old one.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.writelines([data] if isinstance(data, bytes) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
            # on the open file, not its name: in a folder another account owns (a walled Slurm job's), that
            # account could put a link to any file where the name was, and a chmod by name would follow it
            os.fchmod(f.fileno(), mode)
        if check is not None:
            check(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def atomic_write_text(path: Path | str, data: str, *, mode: int = 0o644, durable: bool = True,
                      check: Callable[[Path], object] | None = None) -> Path:
    """`atomic_write_bytes` for text (UTF-8)."""
    return atomic_write_bytes(path, data.encode(), mode=mode, durable=durable, check=check)


def folder_size(path: Path) -> int:
    """Bytes a folder takes on disk (allocated blocks, not file lengths); unreadable entries count 0."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


def open_own_file(path: Path, owner: int | None = None) -> int | None:
    """A read-only descriptor of `path` if it is a plain file with one name (what air writes is renamed into
    place), not a link, and (`owner`) that uid's; else None. See read_own_file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:  # missing, or a link (ELOOP)
        return None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or (owner is not None and st.st_uid != owner):
        os.close(fd)
        return None
    return fd


def read_own_file(path: Path, max_bytes: int | None = None, *, owner: int | None = None,
                  tail_bytes: int | None = None) -> bytes | None:
    """A file that processes of another account may write where it lies (a walled node's work folder, a
    walled Slurm job's folder): never what a link they left there names (a file only the server's account
    may read, linked there hard or soft), nor a FIFO that would block, nor more than `max_bytes`. None
    where there is no such file (or it is larger). `owner`: the file must be this uid's (a folder on the
    way may itself be a link the account made, to another account's folder). `tail_bytes`: its last bytes only."""
    fd = open_own_file(path, owner)
    if fd is None:
        return None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fd)
        if tail_bytes is not None:
            fh.seek(max(st.st_size - tail_bytes, 0))
            return fh.read(tail_bytes)
        if max_bytes is None:
            return fh.read()
        data = fh.read(max_bytes + 1)  # (it may still grow after the fstat)
        return None if len(data) > max_bytes else data
