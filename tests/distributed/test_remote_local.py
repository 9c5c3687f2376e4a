"""`@distributed(remote=True)` on the local profile (no profile configured): the call is a run of kind
`call` in the store, its nodes are process trees on this machine holding slots in the ledger, and the
caller gets every rank's value or the failing rank's own exception."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from air import distributed
from air.backends.ray_agent import tagged_processes_any_node
from air.errors import WorkloadFailureException
from air.store.paths import RunPaths, process_tag
from air.store.run_store import RunStore
from air.store.states import AttemptStatus, FailureClass, RunStatus
from proc_helpers import wait_for


def latest_run():
    return RunStore().list_runs(statuses="all", limit=1)[0]


def test_two_ranks_return_every_value_and_the_run_is_listed_as_success() -> None:
    @distributed(num_accelerators=2, accelerator_type="CPU", remote=True)
    def rank_info(scale: int) -> tuple[int, int, str, int]:
        import os

        print(f"hello from rank {os.environ['RANK']}", flush=True)
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), os.environ["MASTER_ADDR"], scale

    assert rank_info.distributed(7) == [(0, 2, "127.0.0.1", 7), (1, 2, "127.0.0.1", 7)]
    run = latest_run()
    assert (run.kind, run.backend, run.status, run.num_nodes, run.accelerator_type) == (
        "call", "local", RunStatus.SUCCESS, 1, "CPU_2xCPU")
    attempts = RunStore().list_attempts(run.id)
    assert [a.status for a in attempts] == [AttemptStatus.SUCCESS]
    node_log = RunPaths(run.id).node_log(0, 0).read_text()
    assert "hello from rank 0" in node_log and "hello from rank 1" in node_log
    assert RunStore().slot_holders("CPU") == {}  # the slots went back to the ledger
    listed = subprocess.run([sys.executable, "-m", "air.cli.main", "list", "runs", "--all-status"],
                            capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if line.startswith(run.id))
    assert row.split()[1:3] == ["call", "SUCCESS"]  # KIND, STATUS


def test_ranks_on_two_local_nodes_see_their_node_rank() -> None:
    @distributed(num_accelerators=2, accelerator_type="CPU_1xCPU", remote=True)
    def where() -> tuple[int, int, int, int]:
        import os

        return (int(os.environ["RANK"]), int(os.environ["NODE_RANK"]), int(os.environ["LOCAL_RANK"]),
                int(os.environ["LOCAL_WORLD_SIZE"]))

    assert where.distributed() == [(0, 0, 0, 1), (1, 1, 0, 1)]
    run = latest_run()
    assert (run.kind, run.status, run.num_nodes) == ("call", RunStatus.SUCCESS, 2)
    assert RunPaths(run.id).node_log(0, 1).exists()


def test_a_failing_rank_raises_its_own_error_and_the_run_failed() -> None:
    @distributed(num_accelerators=2, accelerator_type="CPU", remote=True)
    def fails() -> int:
        import os

        if os.environ["RANK"] == "1":
            raise ValueError("bad input on rank 1")
        return 0

    with pytest.raises(ValueError, match="bad input on rank 1") as info:
        fails.distributed()
    assert getattr(info.value, "air_rank", None) == 1
    run = latest_run()
    assert (run.kind, run.status) == ("call", RunStatus.FAILED)
    assert run.failure_class is FailureClass.USER_CODE
    assert "ValueError: bad input on rank 1" in (run.termination_reason or "")
    assert not tagged_processes_any_node(process_tag(run.id))


def test_air_cancel_ends_every_rank_of_a_local_remote_call() -> None:
    @distributed(num_accelerators=2, accelerator_type="CPU_1xCPU", remote=True)
    def forever() -> None:
        import time

        print("started", flush=True)
        time.sleep(300)

    def cancel() -> None:
        try:
            wait_for(lambda: any(r.status is RunStatus.RUNNING for r in RunStore().list_runs()),
                     "the run to be RUNNING", timeout=120)
            wait_for(lambda: "started" in RunPaths(latest_run().id).node_log(0, 1).read_text(),
                     "rank 1 to start", timeout=120)
        finally:  # as `air cancel` does: the run's own process sees TERMINATING and ends every rank
            RunStore().transition(latest_run().id, RunStatus.TERMINATING, reason="air cancel")

    thread = threading.Thread(target=cancel)
    thread.start()
    with pytest.raises(WorkloadFailureException, match="canceled"):
        forever.distributed()
    thread.join()
    run = latest_run()
    assert run.status is RunStatus.CANCELED
    assert not tagged_processes_any_node(process_tag(run.id))


def test_ranks_inherit_this_machines_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a Ray node (its agent's environment): the caller's variables, PATH included, plus the rank's."""
    monkeypatch.setenv("AIR_TEST_CALLER_MARKER", "from-the-caller")

    @distributed(num_accelerators=2, accelerator_type="CPU_1xCPU", remote=True)
    def environment() -> tuple[str | None, bool, str]:
        import os

        return os.environ.get("AIR_TEST_CALLER_MARKER"), bool(os.environ.get("PATH")), os.environ["NODE_RANK"]

    assert environment.distributed() == [("from-the-caller", True, "0"), ("from-the-caller", True, "1")]
