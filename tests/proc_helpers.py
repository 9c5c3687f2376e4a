"""Process helpers shared by tests: prove that nothing of a launch survived, wait without bare sleeps."""

from __future__ import annotations

import fcntl
import signal
import struct
import termios
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import psutil


def alive(pids: Iterable[int]) -> list[int]:
    """PIDs still running (zombies count as gone: they hold no resources and cannot run)."""
    running = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                running.append(pid)
        except psutil.NoSuchProcess:
            continue
    return running


def wait_for(predicate: Callable[[], object], what: str, timeout: float = 10.0, interval: float = 0.05) -> object:
    """Poll until `predicate()` is truthy; fail with the last value seen, never a bare sleep."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last seen: {last!r}")


def pipe_unread(fd: int) -> int:
    """Bytes written to a pipe and not read yet (FIONREAD): a test waits for a reader to take a write."""
    return int(struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0])


def read_pids(folder: Path) -> list[int]:
    """PIDs that ranks and their children wrote to `folder` (one file per process)."""
    return [int(p.read_text()) for p in folder.glob("*.pid") if p.read_text().strip()]


def default_sigint() -> None:
    """`preexec_fn` for a caller a test will Ctrl-C: SIGINT back to its default. A suite started as a
    background job (`make test &` in a script) inherits SIGINT ignored, and a Python started with it
    ignored never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
