"""Free ports for MASTER_PORT without races between concurrent launches.

Asking the kernel for port 0 gives a free port, but it is free only until someone binds it: two
launches that ask at the same moment can get the same answer after a release (the race torchrunx and
others have). Each air launch therefore also holds an exclusive `flock` on a per-port lock file for
as long as it uses the port; another air launch skips any port whose lock it cannot take.
"""

from __future__ import annotations

import fcntl
import os
import socket
import tempfile
from pathlib import Path
from types import TracebackType

_LOCK_DIR = Path(tempfile.gettempdir()) / f"air-ports-{os.getuid()}"


class PortReservation:
    """A port this launch owns until `release()`; usable as a context manager."""

    def __init__(self, port: int, lock_fd: int) -> None:
        self.port = port
        self._lock_fd: int | None = lock_fd

    def release(self) -> None:
        if self._lock_fd is not None:
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            finally:
                os.close(self._lock_fd)
                self._lock_fd = None

    def __enter__(self) -> PortReservation:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.release()

    def __del__(self) -> None:  # a forgotten reservation must not leak a descriptor forever
        try:
            self.release()
        except Exception:
            pass


def _kernel_free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def reserve_port(host: str = "127.0.0.1", attempts: int = 64) -> PortReservation:
    """A port that is free now and that no other air launch on this machine will hand out meanwhile."""
    _LOCK_DIR.mkdir(mode=0o700, exist_ok=True)
    for _ in range(attempts):
        port = _kernel_free_port(host)
        fd = os.open(_LOCK_DIR / f"{port}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return PortReservation(port, fd)
    raise OSError(f"could not find a free port on {host} after {attempts} tries")
