"""Code run by the child processes of test_store_concurrency.py (spawned: each opens its own store)."""

from __future__ import annotations

import sqlite3
import time
import traceback
from typing import Any

from air.store.run_store import RunStore
from air.store.states import RunStatus


def older_waiting(db_path: str, run_id: str) -> int:
    """Runs that entered the queue before `run_id` and still wait without slots (must be 0 once granted)."""
    with sqlite3.connect(db_path, timeout=60) as raw:
        return raw.execute(
            "SELECT COUNT(*) FROM runs r, runs me WHERE me.id = ? AND r.status = 'QUEUED' "
            "AND r.queue_seq < me.queue_seq AND NOT EXISTS (SELECT 1 FROM slot_claims c WHERE c.run_id = r.id)",
            (run_id,),
        ).fetchone()[0]


def claim_and_run(index: int, db_path: str, capacity: int, hold_s: float, start: Any, results: Any) -> None:
    """Submit a run, wait for slots first in first out, hold them a moment, end the run."""
    try:
        store = RunStore(db_path)
        shared = store.create_run(experiment="shared", accelerator_type="CPU_1xCPU", num_accelerators=1,
                                  num_nodes=1, idempotency_key="one-submit-many-clients")
        count = 1 + index % 2
        run = store.create_run(experiment=f"w{index}", accelerator_type=f"CPU_{count}xCPU",
                               num_accelerators=count, num_nodes=1, idempotency_key=f"w{index}").run
        store.transition(run.id, RunStatus.QUEUED, expected_from=RunStatus.PENDING)
        start.wait()
        polls = 0
        while (slots := store.try_claim_slots(run.id, "CPU", count, capacity)) is None:
            polls += 1
            time.sleep(0.01)
        t0 = time.monotonic()
        ahead = older_waiting(db_path, run.id)
        store.transition(run.id, RunStatus.RUNNING, expected_from=RunStatus.QUEUED)
        time.sleep(hold_s)
        t1 = time.monotonic()
        store.transition(run.id, RunStatus.SUCCESS, expected_from=RunStatus.RUNNING)  # releases the slots
        results.put(dict(index=index, run_id=run.id, shared=(shared.run.id, shared.existing), slots=slots,
                         t0=t0, t1=t1, ahead=ahead, polls=polls))
    except BaseException:
        results.put(dict(index=index, error=traceback.format_exc()))
