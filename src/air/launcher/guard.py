"""Run one command as a tree that ends when whoever started it ends, even by SIGKILL.

`python -m air.launcher.guard PARENT_PID -- CMD...`, started in its own session by PARENT_PID. The guard
asks the kernel for SIGTERM when that parent dies (pdeathsig), becomes a subreaper (orphans of the
command's tree stay its children, so they can still be found and reaped), and when it is told to stop
(SIGTERM, SIGINT, SIGHUP) or the command exits, ends the command's whole tree: its process group, its
descendants, and every process carrying AIR_PROCESS_TAG when one is set.

Why a separate process: `air ui` runs MLflow's server, whose CLI starts uvicorn, which starts workers. A
SIGTERM (or pdeathsig) to MLflow's CLI ends only that process; its workers keep the port. The guard is
the one process in that tree that knows to end all of it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from types import FrameType

import psutil

from air.launcher.procs import become_subreaper, die_with_parent, terminate_tree
from air.processes import PROCESS_KINDS
from air.settings import AIR_PROCESS_TAG

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Stopped(Exception):
    """Raised by the signal handler, so a blocking wait() is left at once."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def raise_stopped(signum: int, _frame: FrameType | None) -> None:
    raise Stopped(signum)


def guard_argv(command: list[str], parent_pid: int | None = None) -> list[str]:
    """argv that runs `command` under a guard whose parent is `parent_pid` (default: this process)."""
    parent = os.getpid() if parent_pid is None else parent_pid
    return PROCESS_KINDS["guard"].argv(str(parent), "--", *command)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--" or not argv[0].isdigit():
        sys.stderr.write("usage: python -m air.launcher.guard PARENT_PID -- COMMAND [ARGS...]\n")
        return 2
    for sig in STOP_SIGNALS:
        signal.signal(sig, raise_stopped)
    child: subprocess.Popen[bytes] | None = None
    code = 0
    try:
        if not die_with_parent(signal.SIGTERM, int(argv[0])):
            return 128 + signal.SIGTERM  # the parent died before we could ask to follow it
        become_subreaper()
        child = subprocess.Popen(argv[2:])
        code = child.wait()
    except Stopped as stop:
        code = 128 + stop.signum
    finally:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        # The command is in the guard's own group, not a group of its own: it is ended as one of the
        # guard's descendants (by PID and create time), never by a process-group id it no longer owns.
        try:
            others = psutil.Process().children(recursive=True)
        except psutil.Error:
            others = []
        terminate_tree(others=others, tag=os.environ.get(AIR_PROCESS_TAG) or None)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
