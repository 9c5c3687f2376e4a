"""Hang reports (issue 24): every process's stacks are taken at once under one deadline, and a
call's hang clock starts when its ranks are forked, not while the zygote is still importing."""

from __future__ import annotations

import threading

import pytest
import warm_probes as wp

from air import distributed
from air.launcher.stacks import collect


def test_collect_takes_every_processs_stacks_at_once() -> None:
    """Eight tasks that each need all eight running at the same time: a one-after-another collection
    would break the barrier (each waits up to 60 s for the others) and report no stacks."""
    barrier = threading.Barrier(8, timeout=60)

    def task(n: int) -> str:
        barrier.wait()
        return f"stacks of {n}"

    got = collect({f"rank {n}": (lambda n=n: task(n)) for n in range(8)}, deadline_s=120)
    assert got == {f"rank {n}": f"stacks of {n}" for n in range(8)}


def test_collect_keeps_one_deadline_and_goes_on_without_the_late_and_the_failed() -> None:
    stuck = threading.Event()

    def fails() -> str:
        raise RuntimeError("py-spy is gone")

    try:
        got = collect({"rank 0": lambda: "quick", "rank 1": lambda: str(stuck.wait(600)), "rank 2": fails},
                      deadline_s=5)
    finally:
        stuck.set()
    assert got["rank 0"] == "quick"
    assert got["rank 1"] == "(no stacks: not collected within 5 s, with every other process's)"
    assert got["rank 2"] == "(no stacks: RuntimeError: py-spy is gone)"
    assert list(got) == ["rank 0", "rank 1", "rank 2"]  # the order asked for


def test_hang_clock_starts_when_the_ranks_are_forked(monkeypatch: pytest.MonkeyPatch) -> None:
    """The zygote preloads a module that takes 15 s, three times the hang timeout; the ranks, once forked,
    return at once. Counted from the launch, the ranks were "silent" for 15 s and the call raised
    HangError (a test flaked on this under load); counted from the fork, the call succeeds."""
    monkeypatch.setenv("AIR_WARM_START", "1")
    monkeypatch.setenv("AIR_PRELOAD", "warm_slow_zygote_import")
    call = distributed(num_accelerators=2, accelerator_type="CPU", hang_timeout=5.0)
    assert call(wp.plain).distributed() == [0, 1]
