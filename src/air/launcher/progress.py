"""Progress: when each process of a launch last showed a sign of life, and which one hangs.

A process makes progress when it writes a line (the pump notes the time) or calls
`air.runtime.heartbeat()`, which writes the time into its own 8-byte slot: a file in shared memory
(`/dev/shm` where there is one) that the process maps once and the launcher reads (see
air/runtime.py). Descendants inherit the slot's path (AIR_HEARTBEAT_FILE), so a workload node's
Python program beats for its `bash`. Ray Train's `report()` reaches the driver's slot through air's
Ray Train callback, which beats at each report.

`find_hang` is the one place that decides a hang: both the run controller (workloads, remote calls)
and a local `@distributed` call ask it.
"""

from __future__ import annotations

import os
import shutil
import stat
import struct
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

SLOT = struct.Struct("d")


class HeartbeatSlots:
    """One zeroed 8-byte file per process, in a private folder removed by `close()`."""

    def __init__(self, count: int) -> None:
        base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        self.folder = tempfile.mkdtemp(prefix="air-hb-", dir=base)
        self.paths = [os.path.join(self.folder, str(i)) for i in range(count)]
        for path in self.paths:
            with open(path, "wb") as fh:
                fh.write(bytes(SLOT.size))

    def read(self, index: int) -> float:
        """Wall-clock time of the process's last heartbeat; 0.0 if it never beat (or the slot is gone).
        A walled process may replace its slot (its folder is its account's): only a regular file counts,
        opened without following a link and without waiting (a FIFO would block the run's watch)."""
        fd = open_slot(self.paths[index])
        if fd is None:
            return 0.0
        try:
            data = os.pread(fd, SLOT.size, 0)
        except OSError:
            return 0.0
        finally:
            os.close(fd)
        return SLOT.unpack(data)[0] if len(data) == SLOT.size else 0.0

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def open_slot(path: str) -> int | None:
    """A descriptor of `path` when it is a regular file (not a link, FIFO or device), else None: for the
    files root reads in a folder a walled process can write."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


@dataclass(frozen=True)
class Silence:
    """How long one running process of a node has shown no progress (plain data: crosses Ray).

    `process` is its index in the node (a call's local rank; 0 for a workload node's command).
    `stopped`: the process is stopped (SIGSTOP, a debugger), so it cannot be making progress; its
    peers waiting on it in a collective are silent because of it.
    """

    node: int
    process: int
    silent_s: float
    stopped: bool = False


def is_stopped(pid: int | None) -> bool:
    """Whether `pid` is in state T/t (stopped or traced) according to /proc."""
    if pid is None:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            state = fh.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in (b"T", b"t")


def find_hang(silences: Sequence[Silence], timeout_s: float | None) -> Silence | None:
    """The process that hangs, if any has been silent for `timeout_s` or more.

    Among those, a stopped process is the cause (its peers wait on it in a collective, as echoes);
    else the one silent longest, then the lowest node and process.
    """
    if timeout_s is None:
        return None
    silent = [s for s in silences if s.silent_s >= timeout_s]
    if not silent:
        return None
    return min(silent, key=lambda s: (not s.stopped, -s.silent_s, s.node, s.process))


def quiet_for(seconds: float) -> str:
    """'12m', '45s', '2h05m': how long, for "node 1 quiet for 12m"."""
    seconds = max(int(seconds), 0)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h{(seconds % 3600) // 60:02d}m"

