"""Atomic file writes: the one helper every file air writes for others to read goes through."""

from __future__ import annotations

import contextlib
import os
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
        os.chmod(tmp, mode)
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
