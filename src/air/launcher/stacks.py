"""Every Python stack of a process tree, for a hang report: py-spy, else faulthandler through a signal.

py-spy reads a process's memory without stopping it (`--nonblocking`), so it also works on a process
that is itself stopped (SIGSTOP) or stuck in native code. Without py-spy, a rank started by air
(air/distributed/worker.py) has registered faulthandler on SIGUSR2 writing to its AIR_STACKS_FILE;
the file exists only once that handler is in place, so no other process is ever sent the signal
(SIGUSR2 would kill it).

A hang report wants the stacks of every process of an attempt; `collect` takes them all at once under
one deadline, so a report costs one py-spy timeout, not one per process.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

import psutil

from air.launcher.progress import open_slot

#: How long one py-spy dump may take before the report goes on without it.
PY_SPY_TIMEOUT_S = 15.0
#: How long a faulthandler dump is waited for.
FAULTHANDLER_WAIT_S = 2.0
#: How long a hang report waits for the stacks of all its processes together (`collect`).
STACKS_DEADLINE_S = PY_SPY_TIMEOUT_S + 10.0

K = TypeVar("K")


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
    # The file is in a folder the (walled) process can write: one descriptor of a regular file, taken
    # before the signal, is what is read (a link or FIFO swapped in is never followed nor waited on).
    fd = open_slot(stacks_file) if stacks_file else None
    if fd is None:
        return "(no stacks: py-spy is not installed and this process has no faulthandler hook)"
    with os.fdopen(fd, "rb") as fh:
        before = os.fstat(fd).st_size
        try:
            os.kill(proc.pid, signal.SIGUSR2)
        except OSError as exc:
            return f"(no stacks: {exc})"
        deadline = time.monotonic() + FAULTHANDLER_WAIT_S
        while time.monotonic() < deadline and os.fstat(fd).st_size == before:
            time.sleep(0.05)
        time.sleep(0.1)  # let it finish writing
        fh.seek(before)
        text = fh.read(1 << 20).decode("utf-8", "replace").strip()
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
        deadline = time.monotonic() + PY_SPY_TIMEOUT_S + 5  # one deadline for them all
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
    return "\n\n".join(f"pid {p.pid}: {_describe(p)}\n{text}" for p, text in zip(procs, texts, strict=True))


def collect(tasks: Mapping[K, Callable[[], str]], deadline_s: float = STACKS_DEADLINE_S) -> dict[K, str]:
    """Run every stacks task at once (one thread each) and return what each gave within one deadline; a
    task that failed or was still running says so in its text (the report goes on without it)."""
    results: dict[K, str] = {}

    def run(key: K, task: Callable[[], str]) -> None:
        try:
            results[key] = task()
        except Exception as exc:  # one process's stacks never stop the report
            results[key] = f"(no stacks: {type(exc).__name__}: {exc})"

    threads = [threading.Thread(target=run, args=(key, task), name="air-stacks", daemon=True)
               for key, task in tasks.items()]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + deadline_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    late = f"(no stacks: not collected within {deadline_s:g} s, with every other process's)"
    return {key: results.get(key, late) for key in tasks}

