"""Ending whole process trees: ranks, their DataLoader workers, and anything they started.

Three nets, so nothing escapes: the process group of each started process (new session per process),
the psutil descendants of each (also those that left the group), and every process whose environment
carries the launch's AIR_PROCESS_TAG (also those re-parented to init after their parent died).
Before a signal is sent, a PID is checked to be the same process (create time), so a recycled PID of a
stranger is never hit.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Iterable, Sequence
from typing import Protocol

import psutil

from air.constants import TERMINATE_GRACE_S
from air.settings import AIR_PROCESS_TAG


class Waitable(Protocol):
    """What teardown needs of a started process: `subprocess.Popen`, or a warm start's ForkedProcess."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


def tagged_processes(tag: str, *, subtags: bool = False) -> list[psutil.Process]:
    """Processes of this user whose environment holds AIR_PROCESS_TAG=tag (the launch's own marker).

    `subtags`: also `tag.<anything>` (the Ray backend tags node n of an attempt `tag.node<n>`).
    """
    found: list[psutil.Process] = []
    needle = f"{AIR_PROCESS_TAG}={tag}".encode()
    prefix = needle + b"."
    me = os.getpid()
    for pid in psutil.pids():
        if pid == me:
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                entries = fh.read().split(b"\0")
        except OSError:
            continue
        if needle in entries or (subtags and any(e.startswith(prefix) for e in entries)):
            try:
                found.append(psutil.Process(pid))
            except psutil.Error:
                continue
    return found


def _collect(roots: Iterable[psutil.Process], tag: str | None) -> dict[int, psutil.Process]:
    procs: dict[int, psutil.Process] = {}
    for root in roots:
        try:
            if root.is_running():
                procs[root.pid] = root
            for child in root.children(recursive=True):
                procs[child.pid] = child
        except psutil.Error:
            continue
    if tag:
        for proc in tagged_processes(tag):
            procs.setdefault(proc.pid, proc)
    procs.pop(os.getpid(), None)
    return procs


def _signal_all(procs: Iterable[psutil.Process], sig: int, groups: Iterable[int]) -> None:
    for pgid in groups:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    for proc in procs:
        try:
            if proc.is_running():  # is_running also checks create time: never a recycled PID
                proc.send_signal(sig)
        except psutil.Error:
            pass


def _wait_popens(children: Sequence[Waitable], deadline: float) -> None:
    for child in children:
        remaining = deadline - time.monotonic()
        try:
            child.wait(timeout=max(remaining, 0.0))
        except subprocess.TimeoutExpired:
            pass


def terminate_tree(
    children: Sequence[Waitable] = (),
    *,
    others: Iterable[psutil.Process] = (),
    tag: str | None = None,
    grace_s: float = TERMINATE_GRACE_S,
) -> list[int]:
    """SIGTERM everything of the launch, wait `grace_s`, SIGKILL what is left. Idempotent.

    `children` are the launch's own processes: waited on through `Popen` (or a warm start's
    `ForkedProcess`, whose zygote reaps it), so their exit codes stay readable. Each was started in its
    own session, so its PID is also its process group.
    Returns the PIDs that had to be killed with SIGKILL (for diagnostics).
    """
    roots: list[psutil.Process] = list(others)
    for child in children:
        if child.returncode is None:
            try:
                roots.append(psutil.Process(child.pid))
            except psutil.Error:
                pass
    groups = [c.pid for c in children]
    procs = _collect(roots, tag)
    direct = {c.pid for c in children}
    if not procs and all(c.poll() is not None for c in children):
        _signal_all((), signal.SIGKILL, groups)  # leftovers still in a dead leader's group
        return []
    _signal_all(procs.values(), signal.SIGTERM, groups)
    deadline = time.monotonic() + grace_s
    _wait_popens(children, deadline)
    indirect = [p for pid, p in procs.items() if pid not in direct]
    _, alive = psutil.wait_procs(indirect, timeout=max(deadline - time.monotonic(), 0.0))
    # Processes started during the grace period (a rank forking while dying) are collected again.
    late = _collect(roots, tag)
    stragglers = {p.pid: p for p in alive}
    for pid, proc in late.items():
        stragglers.setdefault(pid, proc)
    for child in children:
        if child.poll() is None:
            try:
                stragglers.setdefault(child.pid, psutil.Process(child.pid))
            except psutil.NoSuchProcess:
                pass  # a forked child whose exit its zygote has not reported yet
    _signal_all(stragglers.values(), signal.SIGKILL, groups)
    if stragglers:
        final_deadline = time.monotonic() + max(grace_s, 1.0)
        _wait_popens(children, final_deadline)
        psutil.wait_procs([p for pid, p in stragglers.items() if pid not in direct],
                          timeout=max(final_deadline - time.monotonic(), 0.1))
    return sorted(stragglers)


def reap_tag(tag: str, grace_s: float = TERMINATE_GRACE_S, *, subtags: bool = False) -> int:
    """End every process still carrying `tag` (or, with `subtags`, `tag.<x>`) on this machine (a dead
    owner's leftovers); returns how many there were."""
    leftovers = tagged_processes(tag, subtags=subtags)
    if leftovers:
        terminate_tree(others=leftovers, tag=tag, grace_s=grace_s)
    return len(leftovers)


_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> bool:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(sig: int = signal.SIGTERM, parent_pid: int | None = None) -> bool:
    """Have the kernel send `sig` to this process when its parent dies, even by SIGKILL (Linux pdeathsig).

    `parent_pid` is who the parent should be: if it already died before the call took effect (this
    process then has another parent), returns False and the caller should leave at once.
    """
    if not _prctl(_PR_SET_PDEATHSIG, sig):
        return False
    return parent_pid is None or os.getppid() == parent_pid


def become_subreaper() -> bool:
    """Orphans of this process's descendants are re-parented here, not to init: they stay findable
    (`children(recursive=True)`) and reapable, so a tree can be ended whole."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)
