"""The run's last attempt ends the run without waiting for its MLflow run (issue 24): the controller
joins the attempt's MLflow creation (`wait_ready`) only before a retried attempt's end (RETRY names its
MLflow run); the last attempt's end state is written first and its MLflow end comes after it. The
controller with a fake backend and a spy tracking (no MLflow); the store is the real SQLite one."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from test_controller import FAILED, OK, FakeBackend, FakeJob, make_controller, new_run

from air.store.run_store import RunStore
from air.store.states import RetryPolicy, RunStatus
from air.tracking.attempt_tracking import AttemptTracking


class SpyTracking(AttemptTracking):
    """Notes each `wait_ready` and `end` with what the store said at that moment."""

    def __init__(self, attempt: int, store: RunStore, run_id: str, log: list[tuple[object, ...]]) -> None:
        super().__init__(None, attempt, lambda _line: None)
        self.store, self.run_id, self.log = store, run_id, log

    def _attempt_ended(self) -> bool:
        return self.store.list_attempts(self.run_id)[self.attempt].ended_at is not None

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        self.log.append(("wait_ready", self.attempt, self._attempt_ended(), self.store.get_run(self.run_id).status))
        return True

    def end(self, status: str, reason: str | None = None, *, node_logs: Mapping[int, Path] | None = None,
            rank_logs: Mapping[int, Path] | None = None) -> None:
        self.log.append(("end", self.attempt, status, self.store.get_run(self.run_id).status))


class SpyJob(FakeJob):
    def __init__(self, store: RunStore, run_id: str) -> None:
        super().__init__()
        self.store, self.run_id = store, run_id
        self.log: list[tuple[object, ...]] = []

    def tracking(self, attempt: int, warn: Callable[[str], None]) -> AttemptTracking:
        return SpyTracking(attempt, self.store, self.run_id, self.log)


def test_a_retry_waits_for_its_mlflow_run_and_the_last_attempt_does_not(air_home: Path) -> None:
    store = RunStore()
    run_id = new_run(store)
    job = SpyJob(store, run_id)
    controller = make_controller(run_id, job, FakeBackend([FAILED, OK]), store, RetryPolicy(1))
    assert controller.run() is RunStatus.SUCCESS
    assert store.get_run(run_id).status is RunStatus.SUCCESS
    assert job.log == [
        ("wait_ready", 0, False, RunStatus.RUNNING),  # the retried attempt: before its end is recorded
        ("end", 0, "FAILED", RunStatus.RUNNING),  # and ended in MLflow before the next attempt starts
        ("end", 1, "FINISHED", RunStatus.SUCCESS),  # the last: no wait first; its MLflow end after SUCCESS
    ]


def test_a_final_failure_is_written_without_waiting_for_mlflow(air_home: Path) -> None:
    store = RunStore()
    run_id = new_run(store)
    job = SpyJob(store, run_id)
    controller = make_controller(run_id, job, FakeBackend([FAILED]), store, RetryPolicy(0))
    assert controller.run() is RunStatus.FAILED
    assert store.get_run(run_id).status is RunStatus.FAILED
    assert job.log == [("end", 0, "FAILED", RunStatus.FAILED)]
