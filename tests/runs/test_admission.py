"""One admission loop (issue 25): queued runs are rows with no process; the loop admits them in the ledger's
order and within the per-user limit; cancel of a queued row; a supervisor killed while RUNNING is still
reconciled; the local loop exits when nothing is queued and leaves no process behind. Real `air` processes
and a real SQLite store; the loop's unit tests start no supervisor (their spawn records the test's own pid)."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from air.home import AirHome
from air.runs.admission import AdmissionLoop, loop_running, queued_rows
from air.runs.cancel import cancel_run
from air.runs.reconcile import SUPERVISOR_START_GRACE_S, reconcile
from air.store.paths import RunPaths
from air.store.run_store import Run, RunStore
from air.store.states import RunStatus
from proc_helpers import alive, wait_for


def air(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "air.cli.main", *args], capture_output=True, text=True, timeout=120)


def submit(path: Path) -> str:
    result = air("run", "-f", str(path), "--json")
    assert result.returncode == 0, result.stderr + result.stdout
    return str(json.loads(result.stdout)["data"]["run_id"])


def workload(folder: Path, name: str, command: str) -> Path:
    path = folder / f"{name}.yaml"
    path.write_text(textwrap.dedent(f"""\
        experiment_name: {name}
        compute: {{num_accelerators: 1, accelerator_type: CPU_1xCPU}}
        max_retries: 0
        command: |
          {command}
        """))
    return path


def status_of(run_id: str) -> RunStatus:
    return RunStore().get_run(run_id).status


def supervisors_of(run_ids: list[str]) -> list[int]:
    """Processes of this machine that supervise one of `run_ids` (by their command line)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "air.runs.supervisor" in cmdline and any(run_id in cmdline for run_id in run_ids):
            found.append(proc.pid)
    return found


def admission_loops(home: AirHome) -> list[int]:
    """This AIR_HOME's detached admission loops (by command line and working folder)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "cwd"]):
        if "air.runs.admission" in (proc.info["cmdline"] or []) and proc.info["cwd"] == str(home.root):
            found.append(proc.pid)
    return found


@pytest.fixture
def one_slot(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("AIR_CPU_SLOTS", "1")
    monkeypatch.setenv("AIR_TRACKING", "off")
    yield
    air("cancel", "--all", "-y")


def test_queued_runs_are_rows_admitted_in_order_and_the_loop_exits_clean(tmp_path: Path, one_slot: None) -> None:
    marker = tmp_path / "release"
    order = tmp_path / "order.txt"
    held = submit(workload(tmp_path, "holder", f"while [ ! -e {marker} ]; do sleep 0.1; done"))
    wait_for(lambda: status_of(held) is RunStatus.RUNNING, "the holder to run", timeout=90)
    queued = [submit(workload(tmp_path, f"q{i}", f"echo {i} >> {order}")) for i in range(4)]
    store = RunStore()
    wait_for(lambda: [store.queue_position(r) for r in queued] == [0, 1, 2, 3], "four runs in line", timeout=60)
    # The first in line has its supervisor standing by (it claims the slot the moment it frees); behind
    # it, a queued run is a row: no process, however deep the queue.
    wait_for(lambda: supervisors_of(queued[:1]) != [], "the head's supervisor to stand by", timeout=60)
    time.sleep(1.0)  # the loop has passed over the queue more than once meanwhile
    for run_id in queued[1:]:
        run = store.get_run(run_id)
        assert run.status is RunStatus.QUEUED and run.supervisor_pid is None, run
    assert supervisors_of(queued[1:]) == []
    home = AirHome()
    assert loop_running(home) and len(admission_loops(home)) == 1  # one loop, however many `air run`s

    # A queued row keeps the environment `air run` was typed in, readable by its owner only, until its
    # supervisor starts with it.
    saved = RunPaths(queued[2]).submit_environ
    assert saved.exists() and stat.S_IMODE(saved.stat().st_mode) == 0o600
    assert cancel_run(store, queued[1]) is RunStatus.CANCELED  # a row: canceled at once, nothing to end
    assert store.get_run(queued[1]).supervisor_pid is None and store.claimed_slots(queued[1]) == []

    marker.touch()
    for run_id in [held, queued[0], queued[2], queued[3]]:
        wait_for(lambda r=run_id: store.get_run(r).is_terminal, f"{run_id} to end", timeout=120)
        assert store.get_run(run_id).status is RunStatus.SUCCESS, store.get_run(run_id).termination_reason
    assert order.read_text().split() == ["0", "2", "3"]  # first in first out, the canceled one skipped
    assert not any(RunPaths(r).submit_environ.exists() for r in (queued[0], queued[2], queued[3]))
    starts = [store.get_run(r).started_at or 0.0 for r in (queued[0], queued[2], queued[3])]
    assert starts == sorted(starts)

    loops = admission_loops(home)
    wait_for(lambda: not loop_running(home), "the local admission loop to exit once nothing is queued", timeout=30)
    wait_for(lambda: alive(loops) == [], "the loop's process to be gone", timeout=30)
    wait_for(lambda: supervisors_of([held, *queued]) == [], "every supervisor to exit after its run", timeout=60)


def test_a_supervisor_killed_while_running_is_reconciled_and_the_next_run_starts(tmp_path: Path,
                                                                                  one_slot: None) -> None:
    held = submit(workload(tmp_path, "holder", "sleep 600"))
    store = RunStore()
    wait_for(lambda: store.get_run(held).status is RunStatus.RUNNING, "the holder to run", timeout=90)
    nxt = submit(workload(tmp_path, "next", "echo next"))
    wait_for(lambda: store.queue_position(nxt) == 0, "the next run to wait", timeout=60)
    pid = store.get_run(held).supervisor_pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: alive([pid]) == [], "the supervisor to die")
    result = air("list", "runs", "--json")  # any command reconciles the runs whose supervisor is gone
    assert result.returncode == 0, result.stderr
    run = store.get_run(held)
    assert run.status is RunStatus.INTERNAL_ERROR and f"(pid {pid}) died unexpectedly" in (run.termination_reason or "")
    assert store.get_run(nxt).status is not RunStatus.INTERNAL_ERROR  # a queued row is not a dead supervisor
    wait_for(lambda: store.get_run(nxt).is_terminal, "the next run to be admitted and end", timeout=120)
    assert store.get_run(nxt).status is RunStatus.SUCCESS


# -- the loop itself, on the real store (its spawn starts no supervisor) ------------------------------------
class Recorder:
    """The loop's spawn: records who was admitted, and returns a live pid (this test's) as the supervisor."""

    def __init__(self) -> None:
        self.started: list[str] = []

    def __call__(self, run_id: str, environ: dict[str, str] | None) -> int:
        self.started.append(run_id)
        return os.getpid()


def queue(store: RunStore, user: str, name: str) -> Run:
    run = store.create_run(experiment=name, accelerator_type="CPU_1xCPU", num_accelerators=1, num_nodes=1,
                           user=user).run
    return store.transition(run.id, RunStatus.QUEUED, expected_from=RunStatus.PENDING)


def finish(store: RunStore, run_id: str) -> None:
    store.transition(run_id, RunStatus.RUNNING)
    store.transition(run_id, RunStatus.SUCCESS)


def test_the_loop_admits_first_in_first_out_and_skips_canceled_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIR_CPU_SLOTS", "1")
    store = RunStore()
    runs = [queue(store, "alice", f"r{i}").id for i in range(4)]
    spawn = Recorder()
    loop = AdmissionLoop(store, spawn=spawn)
    assert loop.admit_pass() == [runs[0], runs[1]]  # the first holds the slot; the next stands by for it
    assert store.claimed_slots(runs[0]) == [0] and store.claimed_slots(runs[1]) == []
    assert loop.admit_pass() == []  # nobody else, whatever the depth
    assert store.get_run(runs[1]).supervisor_pid == os.getpid() and queued_rows(store)[0].id == runs[2]
    cancel_run(store, runs[2])  # a row: canceled at once
    finish(store, runs[0])
    assert loop.admit_pass() == []  # the standby is first in line: the freed slot is its to claim
    assert store.try_claim_slots(runs[1], "CPU", 1, 1) == [0]  # (what its supervisor's backend does)
    assert loop.admit_pass() == [runs[3]]  # the next one stands by
    assert spawn.started == [runs[0], runs[1], runs[3]]


def test_the_loop_keeps_the_per_user_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIR_CPU_SLOTS", "3")
    home = AirHome()
    home.root.mkdir(parents=True, exist_ok=True)
    home.config.write_text("max_running_runs_per_user: 1\n")
    store = RunStore()
    a1, a2, b1, a3, b2 = (queue(store, user, name).id for user, name in
                          [("alice", "a1"), ("alice", "a2"), ("bob", "b1"), ("alice", "a3"), ("bob", "b2")])
    loop = AdmissionLoop(store, spawn=Recorder())
    assert loop.admit_pass() == [a1, b1]  # alice at her limit holds up no one behind her
    assert loop.admit_pass() == []
    assert store.claimed_slots(a1) and store.claimed_slots(b1)
    finish(store, a1)
    assert loop.admit_pass() == [a2]  # her next, in her order; bob's b2 waits for his own turn
    finish(store, b1)
    assert loop.admit_pass() == [b2]
    assert [r.id for r in queued_rows(store)] == [a3] and store.claimed_slots(b2)


def test_reconcile_leaves_queued_rows_alone_and_ends_a_run_never_started() -> None:
    store = RunStore()
    rows = [queue(store, "alice", f"q{i}") for i in range(3)]
    pending = store.create_run(experiment="p", accelerator_type="CPU_1xCPU", num_accelerators=1, num_nodes=1).run
    later = max(r.submitted_at for r in [*rows, pending]) + SUPERVISOR_START_GRACE_S + 1
    assert reconcile(store, now=later) == [pending.id]
    assert [store.get_run(r.id).status for r in rows] == [RunStatus.QUEUED] * 3
    assert "never started" in (store.get_run(pending.id).termination_reason or "")
