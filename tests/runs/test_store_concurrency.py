"""Many `air` processes on one runs.db at once: real processes, each with its own connection."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import pytest

from air.store.run_store import RunStore
from air.store.states import RunStatus

PROCESSES = 20
CAPACITY = 2


def test_twenty_processes_create_and_claim_without_overbooking_or_locking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    import runs_mp_worker

    db_path = str(tmp_path / "runs.db")  # not created yet: the children race to create it
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(PROCESSES)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=runs_mp_worker.claim_and_run, args=(i, db_path, CAPACITY, 0.03, start, results))
        for i in range(PROCESSES)
    ]
    for p in procs:
        p.start()
    outcomes: list[dict[str, Any]] = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0

    errors = [o["error"] for o in outcomes if "error" in o]
    assert not errors, errors[0]  # includes any "database is locked"

    # One submission key, many clients: exactly one run, everybody got its id.
    shared = {o["shared"][0] for o in outcomes}
    assert len(shared) == 1 and sum(not o["shared"][1] for o in outcomes) == 1

    # Never more than CAPACITY slots in use, and no slot held by two runs at once. The recorded
    # intervals lie inside the true holding intervals, so an overlap here is a real double booking.
    for i, a in enumerate(outcomes):
        assert all(0 <= s < CAPACITY for s in a["slots"]) and len(a["slots"]) == 1 + a["index"] % 2
        for b in outcomes[i + 1 :]:
            if a["t0"] < b["t1"] and b["t0"] < a["t1"]:
                assert not set(a["slots"]) & set(b["slots"]), (a, b)
    events = sorted([(o["t0"], len(o["slots"])) for o in outcomes] + [(o["t1"], -len(o["slots"])) for o in outcomes],
                    key=lambda e: (e[0], e[1]))
    in_use = peak = 0
    for _, delta in events:
        in_use += delta
        peak = max(peak, in_use)
    assert peak <= CAPACITY

    # First in first out: when a run got its slots, no run queued before it was still waiting.
    assert [o["ahead"] for o in outcomes] == [0] * PROCESSES

    store = RunStore(db_path)
    runs = store.list_runs(statuses="all", limit=None)
    assert len(runs) == PROCESSES + 1
    assert sum(r.status is RunStatus.SUCCESS for r in runs) == PROCESSES
    assert store.slot_holders("CPU") == {}
