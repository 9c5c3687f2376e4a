"""Priorities and preemption (issue 26): `compute.priority_class` orders a pool's queue (CRITICAL, then
NORMAL, then BEST_EFFORT, first in first out within a class), a CRITICAL run that finds its pool full
preempts BEST_EFFORT runs (newest first, as few as needed), which go back to the queue and resume from
AIR_CHECKPOINT_DIR without spending a retry; on `air server` only admins and `--critical-users` may submit
CRITICAL. Real SQLite, real `air` processes, a real server."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from runs_helpers import air, submit, wait_status, wait_terminal, write_workload

from air.store.paths import RunPaths
from air.store.run_store import RunStore
from air.store.states import AttemptStatus, PriorityClass, RunStatus
from proc_helpers import wait_for

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
from server_helpers import running_server  # noqa: E402  (the server tests' helpers, beside this folder)

# ---- the ledger's one rule (real SQLite) --------------------------------------------------------------


def _queued(store: RunStore, name: str, priority: PriorityClass) -> str:
    run = store.create_run(experiment=name, accelerator_type="CPU_1xCPU", num_accelerators=1, num_nodes=1,
                           priority_class=priority).run
    store.transition(run.id, RunStatus.QUEUED)
    return run.id


def test_the_queue_is_ordered_by_priority_then_first_in_first_out(tmp_path: Path) -> None:
    store = RunStore(tmp_path / "runs.db")
    be1 = _queued(store, "be1", PriorityClass.BEST_EFFORT)
    n1 = _queued(store, "n1", PriorityClass.NORMAL)
    c1 = _queued(store, "c1", PriorityClass.CRITICAL)
    n2 = _queued(store, "n2", PriorityClass.NORMAL)
    be2 = _queued(store, "be2", PriorityClass.BEST_EFFORT)
    assert store.queued_ahead(be2) == [c1, n1, n2, be1]
    assert [store.queue_position(r) for r in (c1, n1, n2, be1, be2)] == [0, 1, 2, 3, 4]
    assert store.get_run(c1).priority_class is PriorityClass.CRITICAL
    # Slots go in that order: nobody passes a run ahead of it, even with slots free for them.
    assert store.try_claim_slots(n1, "CPU", 1, 5) is None
    assert store.try_claim_slots(be1, "CPU", 1, 5) is None
    assert store.try_claim_slots(c1, "CPU", 1, 5) == [0]
    assert store.try_claim_slots(n2, "CPU", 1, 5) is None
    assert store.try_claim_slots(n1, "CPU", 1, 5) == [1]
    assert store.queued_ahead(be2) == [n2, be1]
    assert store.try_claim_slots(n2, "CPU", 1, 5) == [2]
    assert store.try_claim_slots(be1, "CPU", 1, 5) == [3]
    assert store.try_claim_slots(be2, "CPU", 1, 5) == [4]


def test_a_critical_run_asks_the_newest_best_effort_runs_for_as_few_slots_as_needed(tmp_path: Path) -> None:
    clock = iter(range(1, 1000))
    store = RunStore(tmp_path / "runs.db", clock=lambda: float(next(clock)))
    old = _queued(store, "old", PriorityClass.BEST_EFFORT)
    normal = _queued(store, "normal", PriorityClass.NORMAL)
    new = _queued(store, "new", PriorityClass.BEST_EFFORT)
    assert store.try_claim_slots(normal, "CPU", 1, 3) == [0]
    assert store.try_claim_slots(old, "CPU", 1, 3) == [1]
    assert store.try_claim_slots(new, "CPU", 1, 3) == [2]
    critical = _queued(store, "critical", PriorityClass.CRITICAL)
    assert store.try_claim_slots(critical, "CPU", 1, 3) is None
    assert [store.get_run(r).preempted_by for r in (old, normal, new)] == [None, None, critical]
    assert store.try_claim_slots(critical, "CPU", 1, 3) is None  # asked already: nobody more
    assert [store.get_run(r).preempted_by for r in (old, normal, new)] == [None, None, critical]
    # Two slots for another CRITICAL run: the NORMAL run is never asked, and the one BEST_EFFORT slot left
    # would not be enough, so nobody more is asked either.
    big = store.create_run(experiment="big", accelerator_type="CPU_1xCPU", num_accelerators=2, num_nodes=2,
                           priority_class=PriorityClass.CRITICAL).run.id
    store.transition(big, RunStatus.QUEUED)
    store.release_slots(new)  # the first preemption done: its slot went back
    assert store.try_claim_slots(critical, "CPU", 1, 3) == [2]
    assert store.try_claim_slots(big, "CPU", 2, 3) is None
    assert store.get_run(old).preempted_by is None


# ---- preemption end to end (real `air run`, real processes) ----------------------------------------------


@pytest.fixture
def two_slots(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("AIR_CPU_SLOTS", "2")
    monkeypatch.setenv("AIR_TRACKING", "off")
    monkeypatch.delenv("DATABRICKS_USE_RESERVED_GPU_POOL", raising=False)
    yield
    air("cancel", "--all", "-y")


def _checkpointing(folder: Path, name: str, gate: Path, priority: str) -> Path:
    """A one-slot run that counts steps into $AIR_CHECKPOINT_DIR/step until `gate` exists, resuming from it."""
    return write_workload(folder, name, f"""
        experiment_name: {name}
        compute: {{num_accelerators: 1, accelerator_type: CPU_1xCPU, priority_class: {priority}}}
        max_retries: 0
        command: |
          ckpt="$AIR_CHECKPOINT_DIR/step"
          step=0
          if [ -e "$ckpt" ]; then step=$(cat "$ckpt"); echo "resumed from step $step (AIR_RESUMED=$AIR_RESUMED)"; fi
          while [ ! -e {gate} ]; do
            step=$((step + 1)); echo $step > "$ckpt.tmp"; mv "$ckpt.tmp" "$ckpt"; echo "step $step"; sleep 0.2
          done
          echo "done at step $step"
    """)


def _steps(run_id: str) -> int:
    ckpt = RunPaths(run_id).checkpoints() / "step"
    try:
        return int(ckpt.read_text().strip() or 0)
    except (OSError, ValueError):
        return 0


def test_a_critical_run_preempts_a_best_effort_run_which_resumes_from_its_checkpoint(
        tmp_path: Path, two_slots: None) -> None:
    gate = tmp_path / "best-effort.go"
    first = submit(_checkpointing(tmp_path, "be-first", gate, "best_effort"))
    wait_status(first, "RUNNING", timeout=120)
    second = submit(_checkpointing(tmp_path, "be-second", gate, "BEST_EFFORT"))
    wait_status(second, "RUNNING", timeout=120)
    wait_for(lambda: _steps(first) >= 2 and _steps(second) >= 2, "both runs to checkpoint", timeout=60)

    critical_gate = tmp_path / "critical.go"
    critical_yaml = write_workload(tmp_path, "critical", f"""
        experiment_name: critical
        compute: {{num_accelerators: 1, accelerator_type: CPU_1xCPU, priority_class: CRITICAL}}
        max_retries: 0
        command: |
          echo critical running
          while [ ! -e {critical_gate} ]; do sleep 0.1; done
    """)
    critical = submit(critical_yaml)
    submitted = time.monotonic()
    wait_status(critical, "RUNNING", timeout=60)
    took = time.monotonic() - submitted
    print(f"the CRITICAL run started {took:.1f} s after its submit returned")
    assert took < 10, f"the CRITICAL run took {took:.1f} s to start"

    store = RunStore()
    # The newest BEST_EFFORT run gave its slot: its attempt ended PREEMPTED; the other one runs on.
    assert store.get_run(first).status is RunStatus.RUNNING
    attempts = store.list_attempts(second)
    assert attempts[0].status is AttemptStatus.PREEMPTED, attempts
    assert critical in (attempts[0].termination_reason or "")
    wait_for(lambda: store.get_run(second).status is RunStatus.QUEUED, "the preempted run to be queued again",
             timeout=30)
    steps_before = _steps(second)
    assert steps_before >= 2
    # A NORMAL run submitted now is ahead of it (priority, then first in first out).
    normal = submit(write_workload(tmp_path, "normal", """
        experiment_name: normal
        compute: {num_accelerators: 1, accelerator_type: CPU_1xCPU}
        command: echo normal done
    """))
    wait_status(normal, "QUEUED", timeout=60)
    assert store.queued_ahead(second) == [normal]
    shown = json.loads(air("get", "run", second, "--json").stdout)["data"]
    assert shown["priority_class"] == "BEST_EFFORT" and shown["status"] == "QUEUED"

    critical_gate.touch()
    assert wait_terminal(critical).status is RunStatus.SUCCESS
    assert wait_terminal(normal).status is RunStatus.SUCCESS
    wait_status(second, "RUNNING", timeout=120)
    normal_run, second_run = store.get_run(normal), store.get_run(second)
    assert normal_run.started_at is not None and second_run.current_attempt == 1
    assert store.list_attempts(second)[1].started_at > normal_run.started_at  # the NORMAL run went first

    gate.touch()
    assert wait_terminal(first).status is RunStatus.SUCCESS
    done = wait_terminal(second)
    assert done.status is RunStatus.SUCCESS, done.termination_reason
    log = RunPaths(second).node_log(1, 0).read_text()
    resumed = [line for line in log.splitlines() if line.startswith("resumed from step ")]
    assert resumed, log
    assert int(resumed[0].split()[3]) >= steps_before and "AIR_RESUMED=1" in resumed[0]
    # max_retries: 0, and yet it ran again: a preemption is not a retry.
    assert (done.attempt_count, done.preemptions, done.retries) == (2, 1, 0)
    assert done.preempted_by is None
    shown = json.loads(air("get", "run", second, "--json").stdout)["data"]
    assert (shown["retries"], shown["preemptions"], shown["attempts"]) == (0, 1, 2)
    text = air("get", "run", second).stdout
    assert "retries: 0, preempted: 1" in text and "BEST_EFFORT" in text, text


def test_priority_class_is_checked_and_shown_in_the_dry_run(tmp_path: Path) -> None:
    bad = write_workload(tmp_path, "bad", """
        experiment_name: bad
        compute: {num_accelerators: 1, accelerator_type: CPU_1xCPU, priority_class: URGENT}
        command: echo hi
    """)
    result = air("run", "-f", str(bad), "--dry-run")
    assert result.returncode == 2 and "priority_class" in result.stderr and "CRITICAL" in result.stderr, result.stderr
    good = write_workload(tmp_path, "good", """
        experiment_name: good
        compute: {num_accelerators: 1, accelerator_type: CPU_1xCPU, priority_class: critical}
        command: echo hi
    """)
    dry = air("run", "-f", str(good), "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    assert json.loads(dry.stdout)["data"]["plan"]["compute"]["priority_class"] == "CRITICAL"
    assert not RunStore().list_runs(statuses="all")


# ---- who may submit CRITICAL on a server ------------------------------------------------------------------


def test_the_server_lets_only_admins_and_critical_users_submit_critical(tmp_path: Path) -> None:
    folder = tmp_path / "work"
    spec = write_workload(folder, "urgent", """
        experiment_name: urgent
        compute: {num_accelerators: 1, accelerator_type: CPU_1xCPU, priority_class: CRITICAL}
        max_retries: 0
        command: echo urgent done
    """)
    with running_server(tmp_path, start_args=("--single-trust-domain", "--critical-users", "alice")) as srv:
        refused = srv.air("bob", "run", "-f", str(spec))
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert "may not submit compute.priority_class: CRITICAL" in refused.stderr, refused.stderr
        status, body = srv.api("POST", "/api/v1/runs", token=srv.tokens["bob"],
                               body={"spec": {"experiment_name": "urgent", "command": "echo hi",
                                              "compute": {"num_accelerators": 1, "accelerator_type": "CPU_1xCPU",
                                                          "priority_class": "critical"}}})
        assert status == 403 and body["error"]["code"] == "PERMISSION_DENIED", body
        assert srv.api("GET", "/api/v1/runs", token=srv.tokens["root"])[1]["runs"] == []  # nothing was made
        run_id = str(srv.air_json("alice", "run", "-f", str(spec))["run_id"])
        assert srv.wait_status(run_id, "SUCCESS") == "SUCCESS"
        assert srv.air_json("alice", "get", "run", run_id)["priority_class"] == "CRITICAL"
        admin = srv.air("root", "run", "-f", str(spec), "--dry-run")
        assert admin.returncode == 0, admin.stderr
        normal = srv.air("bob", "run", "-f", str(spec), "--dry-run", "--override", "compute.priority_class=NORMAL")
        assert normal.returncode == 0, normal.stderr
