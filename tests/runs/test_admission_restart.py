"""The local admission loop restarted when killed (issue 25): runs `air run` queued do not wait for the next
`air run` when their loop died; any `air` command starts a new one. Rows nobody queued through `air run`
(written by hand, as tests and imports do) never start a loop. Real `air` processes, real SQLite."""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

import pytest
from test_admission import admission_loops, air, one_slot, submit, supervisors_of, workload

from air.client.sdk import Client
from air.home import AirHome
from air.runs.admission import ensure_loop, loop_running, waiting_for_local_loop
from air.store.run_store import Run, RunStore
from air.store.states import RunStatus
from proc_helpers import alive, wait_for

__all__ = ["one_slot"]  # the fixture, shared with test_admission


def test_a_killed_admission_loop_is_restarted_by_the_next_command(tmp_path: Path, one_slot: None) -> None:
    marker = tmp_path / "release"
    held = submit(workload(tmp_path, "holder", f"while [ ! -e {marker} ]; do sleep 0.1; done"))
    store = RunStore()
    wait_for(lambda: store.get_run(held).status is RunStatus.RUNNING, "the holder to run", timeout=90)
    queued = [submit(workload(tmp_path, f"q{i}", f"echo {i}")) for i in range(2)]
    wait_for(lambda: [store.queue_position(r) for r in queued] == [0, 1], "two runs in line", timeout=60)
    home = AirHome()
    loops = wait_for(lambda: admission_loops(home), "the local admission loop", timeout=60)
    assert isinstance(loops, list) and len(loops) == 1
    assert waiting_for_local_loop(store)  # the second is a row only the loop starts
    os.kill(loops[0], signal.SIGKILL)
    wait_for(lambda: alive(loops) == [] and not loop_running(home), "the loop to be dead", timeout=30)

    marker.touch()  # the pool frees: the first in line stands by in its own supervisor and takes the slot
    wait_for(lambda: store.get_run(queued[0]).is_terminal, "the standby run to end", timeout=120)
    second = store.get_run(queued[1])
    assert second.status is RunStatus.QUEUED and second.supervisor_pid is None  # no loop: nobody starts it
    assert not loop_running(home) and admission_loops(home) == []

    listed = air("list", "runs", "--json")  # any command: finds it waiting without a loop, starts one
    assert listed.returncode == 0, listed.stderr
    for run_id in [held, *queued]:
        wait_for(lambda r=run_id: store.get_run(r).is_terminal, f"{run_id} to end", timeout=120)
        assert store.get_run(run_id).status is RunStatus.SUCCESS, store.get_run(run_id).termination_reason
    wait_for(lambda: not loop_running(home) and admission_loops(home) == [],
             "the new loop to exit once nothing is queued", timeout=60)
    wait_for(lambda: supervisors_of([held, *queued]) == [], "every supervisor to exit after its run", timeout=60)


def test_rows_not_queued_by_air_run_start_no_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIR_CPU_SLOTS", "1")
    monkeypatch.setenv("AIR_TRACKING", "off")
    store = RunStore()
    row = Run(id=f"run-260101-{uuid.uuid4().hex[:8]}", experiment="by-hand", status=RunStatus.QUEUED, accelerator_type="CPU_1xCPU",
              num_accelerators=1, num_nodes=1, submitted_at=time.time(), user="someone")
    assert store.insert_runs([row]) == 1
    assert not waiting_for_local_loop(store)
    assert ensure_loop(store) is None
    listed = air("list", "runs", "--json")
    assert listed.returncode == 0, listed.stderr
    home = AirHome()
    assert not loop_running(home) and admission_loops(home) == []
    run = store.get_run(row.id)
    assert run.status is RunStatus.QUEUED and run.supervisor_pid is None  # left as it was written

    # The same row marked as `air run` marks it: now a command would start a loop (asked here directly).
    with store.writer() as conn:
        conn.execute("UPDATE runs SET local_admission = 1 WHERE id = ?", (row.id,))
    assert waiting_for_local_loop(store)
    # Canceled in this process through air.Client (`air cancel`'s own path): an `air cancel` process would first
    # start the loop this row now asks for, and that loop could admit the row before the cancel (a race).
    Client().cancel(row.id)
    assert store.get_run(row.id).status is RunStatus.CANCELED and not waiting_for_local_loop(store)
