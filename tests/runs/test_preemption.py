"""The controller's side of preemption (issue 26), with test_controller.py's fake backend and the
real run store: a marked attempt ends PREEMPTED, the run goes back to the queue, and the retry budget
counts only the attempts that failed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from test_controller import FAILED, OK, FakeBackend, FakeJob, make_controller, new_run

from air.store.run_store import RunStore
from air.store.states import AttemptStatus, PriorityClass, RetryPolicy, RunStatus


@pytest.fixture
def store(air_home: Path) -> RunStore:
    return RunStore()


def _critical(store: RunStore) -> str:
    """A CRITICAL run waiting in the queue (what asks a BEST_EFFORT run for its slots)."""
    run_id = store.create_run(experiment="critical", accelerator_type="CPU_1xCPU", num_accelerators=1, num_nodes=1,
                              priority_class=PriorityClass.CRITICAL).run.id
    store.transition(run_id, RunStatus.QUEUED)
    return run_id


def _preempt_first_attempt(store: RunStore, run_id: str, by: str,
                           seen: list[RunStatus]) -> Callable[[Callable[[], bool]], None]:
    def on_wait(should_stop: Callable[[], bool]) -> None:
        if not seen:  # the first attempt only: a CRITICAL run asks for its slots while it runs
            seen.append(store.get_run(run_id).status)
            with store.writer() as conn:
                conn.execute("UPDATE runs SET preempted_by = ? WHERE id = ?", (by, run_id))
    return on_wait


def test_a_preempted_attempt_goes_back_to_the_queue_and_is_not_a_retry(store: RunStore) -> None:
    run_id, critical = new_run(store), _critical(store)
    seen: list[RunStatus] = []
    backend, job = FakeBackend([OK, FAILED, OK], on_wait=_preempt_first_attempt(store, run_id, critical, seen)), FakeJob()
    # One retry allowed: the preemption must not spend it, or the FAILED second attempt would end the run.
    assert make_controller(run_id, job, backend, store, RetryPolicy(1)).run() is RunStatus.SUCCESS
    attempts = store.list_attempts(run_id)
    assert [a.status for a in attempts] == [AttemptStatus.PREEMPTED, AttemptStatus.FAILED, AttemptStatus.SUCCESS]
    assert f"Preempted by CRITICAL run {critical}" in (attempts[0].termination_reason or "")
    assert attempts[0].failure_class is None  # not a failure
    assert backend.handles[0].terminated  # its nodes were ended
    run = store.get_run(run_id)
    assert (run.preemptions, run.retries, run.attempt_count, run.preempted_by) == (1, 1, 3, None)
    assert (backend.held, backend.released) == (3, 3)
    assert any(f"preempted by CRITICAL run {critical}" in line for line in job.lines)


def test_a_mark_of_a_critical_run_canceled_meanwhile_is_ignored(store: RunStore) -> None:
    run_id, critical = new_run(store), _critical(store)
    store.transition(critical, RunStatus.CANCELED, reason="canceled")
    backend = FakeBackend([OK], on_wait=_preempt_first_attempt(store, run_id, critical, []))
    assert make_controller(run_id, FakeJob(), backend, store, RetryPolicy(0)).run() is RunStatus.SUCCESS
    assert [a.status for a in store.list_attempts(run_id)] == [AttemptStatus.SUCCESS]
    assert not backend.handles[0].terminated
    assert (store.get_run(run_id).preemptions, store.get_run(run_id).preempted_by) == (0, None)


def test_an_attempt_that_succeeded_before_it_was_preempted_stays_a_success(store: RunStore) -> None:
    run_id = new_run(store)

    def mark_then_finish(should_stop: Callable[[], bool]) -> None:
        with store.writer() as conn:  # marked, but the nodes end by themselves before the controller looks
            conn.execute("UPDATE runs SET preempted_by = ? WHERE id = ?", ("run-critical", run_id))

    class Finished(FakeBackend):
        def start(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            handle = super().start(*args, **kwargs)
            handle.wait = lambda *, timeout_s, should_stop: (mark_then_finish(should_stop), OK)[1]  # type: ignore[method-assign]
            return handle

    assert make_controller(run_id, FakeJob(), Finished([OK]), store, RetryPolicy(0)).run() is RunStatus.SUCCESS
    run = store.get_run(run_id)
    assert [a.status for a in store.list_attempts(run_id)] == [AttemptStatus.SUCCESS]
    assert (run.preemptions, run.preempted_by) == (0, None)
