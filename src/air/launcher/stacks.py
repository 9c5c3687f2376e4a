"""Every Python stack of a process tree, for a hang report: py-spy, else faulthandler through a signal.

py-spy reads a process's memory without stopping it (`--nonblocking`), so it also works on a process
that is itself stopped (SIGSTOP) or stuck in native code. Without py-spy, a rank started by air
(air/distributed/worker.py) has registered faulthandler on SIGUSR2 writing to its AIR_STACKS_FILE;
the file exists only once that handler is in place, so no other process is ever sent the signal
(SIGUSR2 would kill it).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

#: How long one py-spy dump may take before the report goes on without it.
PY_SPY_TIMEOUT_S = 15.0
#: How long a faulthandler dump is waited for.
FAULTHANDLER_WAIT_S = 2.0


def py_spy() -> str | None:
    """The py-spy executable: beside this Python (a venv's bin/), else on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def _python_tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return []
    out = []
    for proc in procs:
        try:
            if "python" in os.path.basename(proc.exe()).lower():
                out.append(proc)
        except psutil.Error:
            continue
    return out


def _describe(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())[:200]
    except psutil.Error:
        return "?"


def _spy(exe: str, proc: psutil.Process) -> str:
    try:
        done = subprocess.run([exe, "dump", "--nonblocking", "--pid", str(proc.pid)], capture_output=True,
                              text=True, timeout=PY_SPY_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"(py-spy failed: {exc})"
    return (done.stdout or done.stderr).strip()


def _faulthandler(proc: psutil.Process, stacks_file: str | None) -> str:
    if not stacks_file or not os.path.exists(stacks_file):
        return "(no stacks: py-spy is not installed and this process has no faulthandler hook)"
    before = os.path.getsize(stacks_file)
    try:
        os.kill(proc.pid, signal.SIGUSR2)
    except OSError as exc:
        return f"(no stacks: {exc})"
    deadline = time.monotonic() + FAULTHANDLER_WAIT_S
    while time.monotonic() < deadline and os.path.getsize(stacks_file) == before:
        time.sleep(0.05)
    time.sleep(0.1)  # let it finish writing
    with open(stacks_file, encoding="utf-8", errors="replace") as fh:
        fh.seek(before)
        text = fh.read().strip()
    return text or "(no stacks: the process did not answer SIGUSR2; it may be stopped)"


def dump_tree_stacks(pid: int | None, stacks_file: str | None = None) -> str:
    """The Python stacks of `pid` and every Python process below it, each under a `pid N: cmdline` line."""
    if pid is None:
        return "(not started)"
    procs = _python_tree(pid)
    if not procs:
        return f"(no Python process in the tree of pid {pid})"
    exe = py_spy()
    texts = ["(py-spy is not installed)"] * len(procs)
    if exe is None:
        texts = [_faulthandler(p, stacks_file) if p.pid == pid else text for p, text in zip(procs, texts, strict=True)]
    else:  # one py-spy per process, at once (plain threads: a user's `concurrent.py` may shadow the stdlib's)

        def spy(index: int) -> None:
            texts[index] = _spy(exe, procs[index])

        threads = [threading.Thread(target=spy, args=(i,), daemon=True) for i in range(len(procs))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(PY_SPY_TIMEOUT_S + 5)
    return "\n\n".join(f"pid {p.pid}: {_describe(p)}\n{text}" for p, text in zip(procs, texts, strict=True))


__all__ = ["dump_tree_stacks", "py_spy"]
