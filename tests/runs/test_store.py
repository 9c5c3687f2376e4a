"""The run store on a real SQLite file: runs, ids, listing, transitions, attempts, the slot ledger."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from air.errors import GPUValidationError, NotFoundError, UserInputError
from air.store.liveness import supervisor_alive
from air.store.run_store import Run, RunStore, process_create_time
from air.store.schema import SCHEMA_VERSION
from air.store.states import (
    AttemptStatus,
    FailureClass,
    IllegalTransitionError,
    RunStatus,
    StatusConflictError,
)

MakeRun = Callable[..., Run]


# ---- the file -------------------------------------------------------------------------------------


def test_default_path_is_under_air_home_in_wal_mode(store: RunStore, air_home: Path, make_run: MakeRun) -> None:
    make_run()
    assert store.path == air_home.resolve() / "runs.db"
    with sqlite3.connect(store.path) as raw:
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        tables = {r[0] for r in raw.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"runs", "attempts", "slot_claims", "schema_version"} <= tables
    assert store.schema_version() == SCHEMA_VERSION


def test_reopening_keeps_data_and_does_not_migrate_twice(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "runs.db"
    run = RunStore(path).create_run(experiment="e", accelerator_type="CPU_1xCPU", num_accelerators=1,
                                    num_nodes=1).run
    again = RunStore(path)
    assert again.get_run(run.id) == run
    with sqlite3.connect(path) as raw:
        assert raw.execute("SELECT COUNT(*) FROM schema_version").fetchone()[0] == 1


def test_a_newer_schema_is_refused_with_advice(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    RunStore(path).schema_version()
    with sqlite3.connect(path) as raw:
        raw.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION + 1,))
    newer = RunStore(path)
    with pytest.raises(UserInputError, match="newer than this air understands") as info:
        newer.list_runs()
    assert "Upgrade air" in (info.value.hint or "")
    with pytest.raises(UserInputError):
        newer.list_runs()  # refused every time, not only the first


# ---- creating and finding runs ----------------------------------------------------------------------


def test_create_run_records_everything(store: RunStore) -> None:
    result = store.create_run(
        experiment="qwen-sft", accelerator_type="GPU_8xH100", num_accelerators=16, num_nodes=2,
        spec_yaml="experiment_name: qwen-sft\n", run_name="try-1", backend="local", profile="default",
        kind="workload", user="ada", idempotency_key="k-1",
    )
    run = result.run
    assert result.existing is False
    assert run.status is RunStatus.PENDING and not run.is_terminal
    assert store.get_run(run.id) == run
    assert (run.experiment, run.run_name, run.accelerator_type, run.num_accelerators, run.num_nodes) == (
        "qwen-sft", "try-1", "GPU_8xH100", 16, 2,
    )
    assert (run.user, run.kind, run.profile, run.spec_yaml) == ("ada", "workload", "default", "experiment_name: qwen-sft\n")
    assert run.current_attempt is None and run.attempt_count == 0 and run.duration_seconds() is None
    assert run.slot_kind == "GPU"


def test_user_defaults_to_the_os_user(store: RunStore, make_run: MakeRun) -> None:
    assert make_run().user


def test_kind_is_validated(store: RunStore, make_run: MakeRun) -> None:
    with pytest.raises(ValueError):
        make_run(kind="batch")


def test_idempotency_key_returns_the_existing_run(store: RunStore, make_run: MakeRun) -> None:
    first = store.create_run(experiment="a", accelerator_type="CPU_1xCPU", num_accelerators=1, num_nodes=1,
                             idempotency_key="same")
    again = store.create_run(experiment="b", accelerator_type="CPU_1xCPU", num_accelerators=1, num_nodes=1,
                             idempotency_key="same")
    assert again.existing is True and again.run.id == first.run.id and again.run.experiment == "a"
    run, existing = store.create_run(experiment="c", accelerator_type="CPU_1xCPU", num_accelerators=1,
                                     num_nodes=1, idempotency_key="other")
    assert existing is False and run.id != first.run.id
    assert len(store.list_runs(statuses="all")) == 2


def test_get_run_by_full_id_prefix_or_hex(store: RunStore) -> None:
    a = store.create_run(experiment="a", accelerator_type="CPU_1xCPU", num_accelerators=1, num_nodes=1,
                         run_id="run-260101-aaaa1111").run
    store.create_run(experiment="b", accelerator_type="CPU_1xCPU", num_accelerators=1, num_nodes=1,
                     run_id="run-260101-aaab2222")
    assert store.get_run("run-260101-aaaa1111") == a
    assert store.get_run(" RUN-260101-AAAA1 ") == a  # case and blanks forgiven
    assert store.get_run("aaaa") == a  # the random part, as copied from a table
    with pytest.raises(NotFoundError, match="matches more than one run") as info:
        store.get_run("run-260101-aaa")
    assert "run-260101-aaaa1111" in str(info.value.hint) and "run-260101-aaab2222" in str(info.value.hint)
    with pytest.raises(NotFoundError, match="matches more than one run"):
        store.get_run("aaa")


def test_get_run_not_found_suggests_close_ids(store: RunStore) -> None:
    store.create_run(experiment="a", accelerator_type="CPU_1xCPU", num_accelerators=1, num_nodes=1,
                     run_id="run-260101-0123abcd")
    with pytest.raises(NotFoundError, match="Run run-260101-0123abce not found") as info:
        store.get_run("run-260101-0123abce")  # last digit mistyped
    assert "Did you mean run-260101-0123abcd?" in str(info.value)
    with pytest.raises(NotFoundError) as info:
        store.get_run("0132abcd")  # transposed
    assert "run-260101-0123abcd" in str(info.value.hint)
    with pytest.raises(NotFoundError) as info:
        store.get_run("run-250101-ffffffff")
    assert "Did you mean" not in str(info.value) and "air list runs --all-status" in str(info.value)
    assert info.value.exit_code == 2


def test_get_run_refuses_garbage_before_sql(store: RunStore) -> None:
    with pytest.raises(UserInputError):
        store.get_run("x' OR 1=1 --")


# ---- listing ------------------------------------------------------------------------------------------


def test_list_runs_newest_first_active_by_default(store: RunStore, make_run: MakeRun) -> None:
    runs = [make_run(experiment=f"e{i}") for i in range(5)]
    store.transition(runs[1].id, RunStatus.CANCELED)
    store.transition(runs[3].id, RunStatus.QUEUED)
    assert [r.id for r in store.list_runs()] == [runs[4].id, runs[3].id, runs[2].id, runs[0].id]
    assert [r.id for r in store.list_runs(statuses="all")] == [r.id for r in reversed(runs)]
    assert [r.id for r in store.list_runs(statuses=[RunStatus.CANCELED, RunStatus.QUEUED])] == [
        runs[3].id, runs[1].id,
    ]
    assert store.list_runs(statuses=[]) == []
    assert [r.id for r in store.list_runs(statuses="all", limit=2)] == [runs[4].id, runs[3].id]
    assert len(store.list_runs(statuses="all", limit=None)) == 5
    with pytest.raises(UserInputError):
        store.list_runs(limit=0)


def test_list_runs_filters(store: RunStore, make_run: MakeRun) -> None:
    qwen = make_run(experiment="Qwen-SFT", accelerator_type="GPU_8xH100", num_accelerators=16, num_nodes=2)
    llama = make_run(experiment="llama_dpo", accelerator_type="GPU_1xA10", num_accelerators=1, num_nodes=1,
                     user="bob")
    cpu = make_run(experiment="qwen-eval", accelerator_type="CPU_2xCPU", num_accelerators=2, num_nodes=1)

    def ids(**kw: object) -> list[str]:
        return [r.id for r in store.list_runs(statuses="all", **kw)]  # type: ignore[arg-type]

    assert ids(experiment_glob="qwen*") == [cpu.id, qwen.id]  # case-insensitive glob
    assert ids(experiment_glob="*_dpo") == [llama.id]
    assert ids(experiment_glob="qwen-[se]*") == [cpu.id, qwen.id]
    assert ids(experiment_glob="nope*") == []
    assert ids(accelerator_type="h100") == [qwen.id]  # substring of the chip name
    assert ids(accelerator_type="GPU_1xA10") == [llama.id]  # or the whole partition name
    assert ids(accelerator_type="gpu") == [llama.id, qwen.id]
    assert ids(num_accelerators=16) == [qwen.id]
    assert ids(user="bob") == [llama.id]
    assert ids(experiment_glob="qwen*", accelerator_type="CPU", num_accelerators=2) == [cpu.id]
    assert ids(experiment_glob="%") == [] and ids(accelerator_type="%") == []  # no LIKE wildcards leak in


def test_bulk_insert_and_list_use_indexes(store: RunStore) -> None:
    runs = [
        Run(id=f"run-260101-{i:08x}", experiment=f"exp{i % 7}", status=RunStatus.SUCCESS if i % 50 else RunStatus.RUNNING,
            accelerator_type="GPU_1xH100", num_accelerators=1, num_nodes=1, submitted_at=1_700_000_000.0 + i)
        for i in range(2000)
    ]
    assert store.insert_runs(runs) == 2000
    assert [r.id for r in store.list_runs(statuses="all", limit=3)] == [r.id for r in runs[-1:-4:-1]]
    assert len(store.list_runs(limit=None)) == 40
    conn = sqlite3.connect(store.path)
    plan = " ".join(str(r) for r in conn.execute(
        "EXPLAIN QUERY PLAN SELECT id FROM runs ORDER BY submitted_at DESC, id DESC LIMIT 20"
    ))
    assert "runs_by_submitted" in plan and "TEMP B-TREE" not in plan
    plan = " ".join(str(r) for r in conn.execute(
        "EXPLAIN QUERY PLAN SELECT id FROM runs WHERE status IN ('PENDING', 'RUNNING') "
        "ORDER BY submitted_at DESC, id DESC LIMIT 20"
    ))
    assert "USING INDEX runs_by_status" in plan
    conn.close()


# ---- transitions ---------------------------------------------------------------------------------------


def test_lifecycle_with_a_retry(store: RunStore, make_run: MakeRun) -> None:
    run = make_run()
    store.transition(run.id, RunStatus.QUEUED)
    running = store.transition(run.id, RunStatus.RUNNING, expected_from=RunStatus.QUEUED)
    assert running.started_at is not None and running.ended_at is None
    a0 = store.start_attempt(run.id, mlflow_run_id="mlf-0")
    assert a0.index == 0 and a0.status is AttemptStatus.RUNNING
    done0 = store.finish_attempt(run.id, 0, AttemptStatus.FAILED, reason="ValueError: bad lr",
                                 failure_class=FailureClass.USER_CODE, exit_code=1)
    assert (done0.exit_code, done0.termination_reason, done0.failure_class) == (1, "ValueError: bad lr",
                                                                                 FailureClass.USER_CODE)
    waiting = store.transition(run.id, RunStatus.WAITING_FOR_RETRY, reason="ValueError: bad lr",
                               failure_class=FailureClass.USER_CODE)
    assert waiting.termination_reason == "ValueError: bad lr"
    store.transition(run.id, RunStatus.RUNNING)
    a1 = store.start_attempt(run.id)
    assert a1.index == 1 and store.get_run(run.id).current_attempt == 1
    store.finish_attempt(run.id, 1, AttemptStatus.SUCCESS, exit_code=0)
    final = store.transition(run.id, RunStatus.SUCCESS, expected_from=RunStatus.RUNNING)
    assert final.status is RunStatus.SUCCESS and final.ended_at is not None
    assert final.started_at == running.started_at  # the first start, kept
    assert final.termination_reason is None and final.failure_class is None  # success clears them
    assert final.attempt_count == 2 and final.mlflow_run_id == "mlf-0"
    assert final.duration_seconds() == pytest.approx(final.ended_at - final.started_at)
    assert [a.status for a in store.list_attempts(run.id)] == [AttemptStatus.FAILED, AttemptStatus.SUCCESS]
    assert store.get_attempt(run.id).index == 1 and store.get_attempt(run.id, 0).mlflow_run_id == "mlf-0"


def test_compare_and_set_conflict_changes_nothing(store: RunStore, make_run: MakeRun) -> None:
    run = make_run()
    store.transition(run.id, RunStatus.QUEUED)
    store.transition(run.id, RunStatus.RUNNING)
    store.transition(run.id, RunStatus.TERMINATING, reason="Canceled by the user")  # `air cancel` won the race
    with pytest.raises(StatusConflictError, match="is TERMINATING, not RUNNING") as info:
        store.transition(run.id, RunStatus.SUCCESS, expected_from=RunStatus.RUNNING)
    assert info.value.current == "TERMINATING"
    assert store.get_run(run.id).status is RunStatus.TERMINATING
    ended = store.transition(run.id, RunStatus.CANCELED, expected_from=[RunStatus.TERMINATING, RunStatus.RUNNING],
                             failure_class=FailureClass.CANCEL)
    assert ended.status is RunStatus.CANCELED and ended.termination_reason == "Canceled by the user"


def test_illegal_transitions_raise_and_change_nothing(store: RunStore, make_run: MakeRun) -> None:
    run = make_run()
    with pytest.raises(IllegalTransitionError, match="cannot go from PENDING to SUCCESS"):
        store.transition(run.id, RunStatus.SUCCESS)
    store.transition(run.id, RunStatus.QUEUED)
    store.transition(run.id, RunStatus.RUNNING)
    with pytest.raises(IllegalTransitionError):
        store.transition(run.id, RunStatus.CANCELED)  # must go through TERMINATING
    store.transition(run.id, RunStatus.FAILED, reason="Exit code 3", failure_class=FailureClass.USER_CODE)
    with pytest.raises(IllegalTransitionError, match="already ended"):
        store.transition(run.id, RunStatus.RUNNING)
    with pytest.raises(NotFoundError):
        store.transition("run-260101-00000000", RunStatus.QUEUED)
    assert store.get_run(run.id).status is RunStatus.FAILED


def test_ending_a_run_closes_its_running_attempt_and_frees_its_slots(store: RunStore, make_run: MakeRun) -> None:
    run = make_run()
    store.transition(run.id, RunStatus.QUEUED)
    assert store.try_claim_slots(run.id, "CPU", 2, 4) == [0, 1]
    store.transition(run.id, RunStatus.RUNNING)
    store.start_attempt(run.id)
    ended = store.transition(run.id, RunStatus.INTERNAL_ERROR, reason="The supervisor died (pid 123)",
                             failure_class=FailureClass.INFRASTRUCTURE)
    assert ended.failure_class is FailureClass.INFRASTRUCTURE
    attempt = store.get_attempt(run.id, 0)
    assert attempt.status is AttemptStatus.INTERNAL_ERROR and attempt.ended_at == ended.ended_at
    assert attempt.termination_reason == "The supervisor died (pid 123)"
    assert store.claimed_slots(run.id) == [] and store.slot_holders("CPU") == {}


def test_attempt_rules(store: RunStore, make_run: MakeRun) -> None:
    run = make_run()
    with pytest.raises(NotFoundError, match="has not started an attempt"):
        store.get_attempt(run.id)
    assert store.list_attempts(run.id) == []
    store.start_attempt(run.id)
    with pytest.raises(IllegalTransitionError, match="still RUNNING"):
        store.start_attempt(run.id)
    store.finish_attempt(run.id, 0, AttemptStatus.TIMEDOUT, failure_class=FailureClass.TIMEOUT, signal=9)
    with pytest.raises(IllegalTransitionError, match="Attempt 0 of run .* is TIMEDOUT"):
        store.finish_attempt(run.id, 0, AttemptStatus.SUCCESS)
    assert store.get_attempt(run.id, 0).signal_name == "SIGKILL"
    with pytest.raises(NotFoundError, match="no attempt 5") as info:
        store.get_attempt(run.id, 5)
    assert "0 to 0" in str(info.value.hint)
    with pytest.raises(NotFoundError):
        store.finish_attempt(run.id, 7, AttemptStatus.FAILED)
    with pytest.raises(NotFoundError):
        store.list_attempts("run-260101-00000000")
    store.transition(run.id, RunStatus.TIMEDOUT)
    with pytest.raises(IllegalTransitionError, match="already ended"):
        store.start_attempt(run.id)


def test_mlflow_and_supervisor_fields(store: RunStore, make_run: MakeRun) -> None:
    run = make_run()
    store.start_attempt(run.id)
    store.set_mlflow_run_id(run.id, "abc123", attempt=0)
    assert store.get_run(run.id).mlflow_run_id == "abc123"
    assert store.get_attempt(run.id, 0).mlflow_run_id == "abc123"
    with pytest.raises(NotFoundError):
        store.set_mlflow_run_id(run.id, "x", attempt=3)

    assert supervisor_alive(run) is None  # none recorded yet
    store.set_supervisor(run.id, os.getpid())
    mine = store.get_run(run.id)
    assert mine.supervisor_pid == os.getpid()
    assert mine.supervisor_started_at == pytest.approx(process_create_time(os.getpid()))
    assert supervisor_alive(mine) is True

    # Same pid, different create time: the pid was reused by someone else.
    assert mine.supervisor_started_at is not None
    store.set_supervisor(run.id, os.getpid(), started_at=mine.supervisor_started_at - 3600)
    assert supervisor_alive(store.get_run(run.id)) is False

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    created = process_create_time(gone.pid)
    gone.wait()
    assert created is not None and process_create_time(gone.pid) is None
    store.set_supervisor(run.id, gone.pid, started_at=created)
    assert supervisor_alive(store.get_run(run.id)) is False
    with pytest.raises(ValueError):
        store.set_supervisor(run.id, gone.pid)


# ---- the slot ledger ------------------------------------------------------------------------------------


def queued(store: RunStore, make_run: MakeRun, **kw: object) -> str:
    run = make_run(**kw)
    store.transition(run.id, RunStatus.QUEUED)
    return run.id


def test_slots_are_first_in_first_out(store: RunStore, make_run: MakeRun) -> None:
    a, b, c = (queued(store, make_run) for _ in range(3))
    assert store.try_claim_slots(a, "CPU", 3, 4) == [0, 1, 2]
    store.transition(a, RunStatus.RUNNING)
    assert store.queue_position(b) == 0 and store.queue_position(c) == 1 and store.queue_position(a) is None
    assert store.try_claim_slots(c, "CPU", 1, 4) is None  # one slot is free, but b is older and waiting
    assert store.try_claim_slots(b, "CPU", 2, 4) is None  # b needs two
    assert store.release_slots(a) == [0, 1, 2]
    assert store.release_slots(a) == []  # idempotent
    assert store.try_claim_slots(c, "CPU", 1, 4) is None  # still b's turn
    assert store.try_claim_slots(b, "CPU", 2, 4) == [0, 1]
    assert store.try_claim_slots(c, "CPU", 1, 4) == [2]
    assert store.slot_holders("cpu") == {0: b, 1: b, 2: c}


def test_fifo_is_per_slot_kind_and_backend(store: RunStore, make_run: MakeRun) -> None:
    gpu_waiting = queued(store, make_run, accelerator_type="GPU_1xH100", num_accelerators=1)
    ray_waiting = queued(store, make_run, backend="ray")
    cpu = queued(store, make_run)
    assert store.try_claim_slots(cpu, "CPU", 2, 2) == [0, 1]  # neither older run is in its line
    assert store.try_claim_slots(gpu_waiting, "GPU", 1, 1) == [0]
    assert store.queue_position(ray_waiting) == 0


def test_claims_are_idempotent_and_checked(store: RunStore, make_run: MakeRun) -> None:
    run = queued(store, make_run)
    assert store.try_claim_slots(run, "CPU", 2, 2) == [0, 1]
    assert store.try_claim_slots(run, "CPU", 2, 2) == [0, 1]  # a supervisor asking again gets the same
    assert store.claimed_slots(run) == [0, 1]
    with pytest.raises(GPUValidationError, match="needs 3 CPU slots; this machine has 2"):
        store.try_claim_slots(run, "CPU", 3, 2)
    with pytest.raises(ValueError):
        store.try_claim_slots(run, "TPU", 1, 2)
    with pytest.raises(NotFoundError):
        store.try_claim_slots("run-260101-00000000", "CPU", 1, 2)
    pending = make_run()
    with pytest.raises(StatusConflictError, match="not QUEUED"):
        store.try_claim_slots(pending.id, "CPU", 1, 2)


def test_a_retry_keeps_its_place_in_the_queue(store: RunStore, make_run: MakeRun) -> None:
    first = queued(store, make_run)
    assert store.try_claim_slots(first, "CPU", 1, 1) == [0]
    second = queued(store, make_run)
    store.transition(first, RunStatus.RUNNING)
    store.release_slots(first)
    store.transition(first, RunStatus.WAITING_FOR_RETRY)
    store.transition(first, RunStatus.QUEUED)
    assert store.queue_position(second) == 1
    assert store.try_claim_slots(second, "CPU", 1, 1) is None
    assert store.try_claim_slots(first, "CPU", 1, 1) == [0]


def test_a_canceled_waiter_unblocks_the_queue(store: RunStore, make_run: MakeRun) -> None:
    a, b = queued(store, make_run), queued(store, make_run)
    assert store.try_claim_slots(b, "CPU", 1, 4) is None
    store.transition(a, RunStatus.CANCELED)
    assert store.try_claim_slots(b, "CPU", 1, 4) == [0]


def test_a_store_carried_across_fork_reopens(store: RunStore, make_run: MakeRun) -> None:
    run = make_run()
    pid = os.fork()
    if pid == 0:  # child: use the parent's store object
        code = 0
        try:
            store.transition(run.id, RunStatus.QUEUED)
        except BaseException:
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert store.get_run(run.id).status is RunStatus.QUEUED  # the parent's connection still works


def test_queued_ahead_names_the_runs_in_front_in_queue_order(store: RunStore, make_run: MakeRun) -> None:
    a, b, c = (queued(store, make_run) for _ in range(3))
    gpu = queued(store, make_run, accelerator_type="GPU_1xH100", num_accelerators=1)
    assert store.queued_ahead(c) == [a, b] and store.queued_ahead(a) == []
    assert store.queued_ahead(gpu) == []  # another slot kind is another line
    assert store.try_claim_slots(a, "CPU", 1, 1) == [0]
    assert store.queued_ahead(c) == [b] and store.queued_ahead(a) == []  # a holder waits for nothing
    assert len(store.queued_ahead(c)) == store.queue_position(c)  # the same rule as the FIFO check
    store.transition(b, RunStatus.CANCELED)
    assert store.queued_ahead(c) == []


def test_pools_queue_apart_and_a_user_at_the_limit_holds_up_no_one(store: RunStore, make_run: MakeRun) -> None:
    a1 = queued(store, make_run, user="alice", pool="p", accelerator_type="CPU_1xCPU", num_accelerators=1)
    a2 = queued(store, make_run, user="alice", pool="p", accelerator_type="CPU_1xCPU", num_accelerators=1)
    other = queued(store, make_run, user="alice", pool="q", accelerator_type="CPU_1xCPU", num_accelerators=1)
    b1 = queued(store, make_run, user="bob", pool="p", accelerator_type="CPU_1xCPU", num_accelerators=1)
    assert store.try_claim_slots(a1, "CPU", 1, 8, slots=[0, 1, 2], user_limit=1) == [0]
    assert store.queued_ahead(b1) == [a2]  # without the limit, a2 is ahead of b1
    assert store.queued_ahead(b1, user_limit=1) == []  # alice is at 1 of 1: a2 holds up no one
    assert store.try_claim_slots(a2, "CPU", 1, 8, slots=[0, 1, 2], user_limit=1) is None
    assert store.try_claim_slots(b1, "CPU", 1, 8, slots=[0, 1, 2], user_limit=1) == [1]
    assert store.try_claim_slots(other, "CPU", 1, 8, slots=[3], user_limit=2) == [3]  # its own pool's slot
    assert store.running_runs_of("alice") == 2 and store.running_runs_of("bob") == 1
    with pytest.raises(GPUValidationError, match="its pool has 3"):
        store.try_claim_slots(a2, "CPU", 4, 8, slots=[0, 1, 2])


def test_ray_runs_are_admitted_first_in_first_out_per_pool_within_the_limit(store: RunStore,
                                                                             make_run: MakeRun) -> None:
    a1, a2 = (queued(store, make_run, user="alice", backend="ray", pool="edge") for _ in range(2))
    b1 = queued(store, make_run, user="bob", backend="ray", pool="edge")
    assert store.try_admit(b1) is False  # a1 and a2 came first
    assert store.try_admit(a1, user_limit=1) is True
    assert store.try_admit(b1, user_limit=1) is False  # a1 is admitted but not placed: it still waits ahead
    store.transition(a1, RunStatus.RUNNING)
    assert store.try_admit(a2, user_limit=1) is False  # alice has 1 of 1
    assert store.queued_ahead(b1, user_limit=1, admitted_wait=True) == []
    assert store.try_admit(b1, user_limit=1) is True
    store.transition(a1, RunStatus.SUCCESS)  # ending gives the admission back
    assert store.try_admit(a2, user_limit=1) is True
