"""The run controller's transitions, step by step, with a fake backend and a fake clock (no process is
started: these run in well under a second). The run store is the real one (SQLite in a tmp AIR_HOME)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from air.accelerators import AcceleratorType, cpu_type
from air.backends.base import Allocation, AttemptOutcome, NodeExit, NodeLaunch
from air.errors import LaunchError
from air.launcher.node import ProcessExit, ProcessSpec
from air.launcher.progress import Silence
from air.runs.controller import AttemptVerdict, Phase, RunController, SetupFailure
from air.runs.listeners import default_listeners
from air.store.paths import RunPaths
from air.store.run_store import RunStore
from air.store.states import AttemptStatus, FailureClass, RetryPolicy, RunStatus
from air.tracking.attempt_tracking import AttemptTracking

OK = AttemptOutcome((NodeExit(0, 0, None),), None)
FAILED = AttemptOutcome((NodeExit(0, 3, None),), NodeExit(0, 3, None))
TIMED_OUT = AttemptOutcome((NodeExit(0, -15, "SIGTERM", True),), None, timed_out=True)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeHandle:
    master_addr = "127.0.0.1"
    master_port = 1

    def __init__(self, outcome: AttemptOutcome | None, on_wait: Callable[[Callable[[], bool]], None] | None) -> None:
        self.outcome = outcome
        self.on_wait = on_wait
        self.timeouts: list[float | None] = []
        self.terminated = False
        self.silent: list[Silence] = []  # what silences() reports: the test sets it

    def wait(self, *, timeout_s: float | None, should_stop: Callable[[], bool]) -> AttemptOutcome:
        self.timeouts.append(timeout_s)
        if self.on_wait is not None:
            self.on_wait(should_stop)
        if should_stop():
            self.terminated = True
            return AttemptOutcome((NodeExit(0, -15, "SIGTERM", True),), None, stopped=True)
        assert self.outcome is not None
        return self.outcome

    def terminate(self) -> None:
        self.terminated = True

    def silences(self) -> list[Silence]:
        return list(self.silent)

    def stacks(self, node: int, process: int) -> str:
        return f"stacks of node {node} process {process}"

    def fetch_files(self, node: int, names: Sequence[str], max_bytes: int | None = None) -> dict[str, bytes | None]:
        return dict.fromkeys(names)

    def process_exits(self, node: int) -> list[ProcessExit] | None:
        return [ProcessExit(0, "node 0", 0, None)]

    def ended_nodes(self) -> set[int]:
        return set()

    def take_system_samples(self) -> None:
        return None  # the nodes run "here": the attempt's tracking samples this machine


class FakeBackend:
    """Capacity is granted at once unless `queued` (then it waits for should_stop); each start takes the
    next scripted outcome."""

    name = "fake"

    def __init__(self, outcomes: list[AttemptOutcome], *, queued: bool = False,
                 on_wait: Callable[[Callable[[], bool]], None] | None = None, start_error: Exception | None = None):
        self.outcomes = list(outcomes)
        self.queued = queued
        self.on_wait = on_wait
        self.start_error = start_error
        self.held = 0
        self.released = 0
        self.handles: list[FakeHandle] = []
        self.reaped: list[str] = []

    def acquire(self, run_id: str, accelerator: AcceleratorType, num_nodes: int, *,
                should_stop: Callable[[], bool], on_wait: Callable[[str], None]) -> Allocation | None:
        while self.queued:
            on_wait("waiting for capacity")
            if should_stop():
                return None
        self.held += 1
        return Allocation(run_id, accelerator, num_nodes, (("0",),))

    def start(self, allocation: Allocation, launches: Sequence[NodeLaunch], *, tag: str, on_line=None) -> FakeHandle:
        if self.start_error is not None:
            raise self.start_error
        handle = FakeHandle(self.outcomes.pop(0) if self.outcomes else None, self.on_wait)
        self.handles.append(handle)
        return handle

    def release(self, allocation: Allocation) -> None:
        self.released += 1

    def reap(self, tag: str) -> int:
        self.reaped.append(tag)
        return 0


class FakeJob:
    accelerator = cpu_type(1)
    num_nodes = 1
    on_line = None

    def __init__(self, timeout_s: float | None = None, setup_error: str | None = None,
                 hang_timeout_s: float | None = None) -> None:
        self.timeout_s = timeout_s
        self.hang_timeout_s = hang_timeout_s
        self.setup_error = setup_error
        self.lines: list[str] = []
        self.held_while_running: list[bool] = []
        self._holding = False

    def say(self, line: str) -> None:
        self.lines.append(line)

    on_wait = say

    def process_label(self, node: int, process: int) -> str:
        return f"node {node}"

    def tracking(self, attempt: int, warn: Callable[[str], None]) -> AttemptTracking:
        return AttemptTracking.off(attempt)

    def attempt_log(self, attempt: int, node_logs: dict[int, Path]) -> Callable[[str], None]:
        return self.say

    @contextlib.contextmanager
    def launches(self, attempt, allocation, node_logs, tracking_env, air_log) -> Iterator[list[NodeLaunch]]:
        if self.setup_error:
            raise SetupFailure(self.setup_error)
        self._holding = True
        try:
            yield [NodeLaunch.command(0, ["true"], {}, node_logs[0])]
        finally:
            self._holding = False

    def judge(self, attempt, handle, outcome, node_logs) -> AttemptVerdict:
        self.held_while_running.append(self._holding)
        if outcome.stopped:
            return AttemptVerdict.failed("Canceled", FailureClass.CANCEL)
        if outcome.timed_out:
            return AttemptVerdict.failed("Timed out", FailureClass.TIMEOUT)
        if outcome.ok:
            return AttemptVerdict(True, values=[1])
        return AttemptVerdict(False, "exit 3", FailureClass.USER_CODE, exit_code=3)

    def rank_logs(self) -> dict[int, Path]:
        return {}


@pytest.fixture
def store(air_home: Path) -> RunStore:
    return RunStore()


def make_controller(run_id: str, job: FakeJob, backend: FakeBackend, store: RunStore, policy: RetryPolicy,
                    **how: Any) -> RunController:
    """A controller as the supervisor builds one: with the default listeners (tracking, progress...)."""
    return RunController(run_id, job, backend, store, policy, listeners=default_listeners(job, store), **how)


def new_run(store: RunStore) -> str:
    return store.create_run(experiment="e", accelerator_type="CPU_1xCPU", num_accelerators=1, num_nodes=1,
                            kind="call").run.id


def steps(controller: RunController) -> list[tuple[Phase, Phase, RunStatus | None]]:
    out = []
    while controller.phase is not Phase.DONE:
        t = controller.step()
        out.append((t.before, t.after, t.status))
    return out


def test_success_is_acquire_start_wait_finish(store: RunStore) -> None:
    run_id = new_run(store)
    backend, job = FakeBackend([OK]), FakeJob()
    controller = make_controller(run_id, job, backend, store, RetryPolicy(0))
    assert steps(controller) == [(Phase.ACQUIRE, Phase.START, None), (Phase.START, Phase.WAIT, None),
                                 (Phase.WAIT, Phase.FINISH, None), (Phase.FINISH, Phase.DONE, RunStatus.SUCCESS)]
    assert store.get_run(run_id).status is RunStatus.SUCCESS
    assert [a.status for a in store.list_attempts(run_id)] == [AttemptStatus.SUCCESS]
    assert (backend.held, backend.released) == (1, 1)
    assert controller.last_verdict is not None and controller.last_verdict.values == [1]
    assert job.held_while_running == [False]  # the job's hold (an environment) ends when the nodes end


def test_a_failed_attempt_is_retried_then_succeeds(store: RunStore) -> None:
    run_id = new_run(store)
    backend, job = FakeBackend([FAILED, OK]), FakeJob()
    controller = make_controller(run_id, job, backend, store, RetryPolicy(1))
    phases = steps(controller)
    assert (Phase.FINISH, Phase.ACQUIRE, None) in phases and phases[-1] == (Phase.FINISH, Phase.DONE, RunStatus.SUCCESS)
    assert len(phases) == 8
    attempts = store.list_attempts(run_id)
    assert [a.status for a in attempts] == [AttemptStatus.FAILED, AttemptStatus.SUCCESS]
    assert attempts[0].exit_code == 3 and attempts[0].failure_class is FailureClass.USER_CODE
    assert (backend.held, backend.released) == (2, 2)
    assert any("retrying" in line for line in job.lines)


def test_no_retries_left_fails_the_run(store: RunStore) -> None:
    run_id = new_run(store)
    backend = FakeBackend([FAILED, FAILED])
    assert make_controller(run_id, FakeJob(), backend, store, RetryPolicy(1)).run() is RunStatus.FAILED
    run = store.get_run(run_id)
    assert run.attempt_count == 2 and run.termination_reason == "exit 3"
    assert backend.released == 2


def test_timeout_goes_to_the_handle_and_ends_timedout(store: RunStore) -> None:
    run_id = new_run(store)
    backend = FakeBackend([TIMED_OUT])
    assert make_controller(run_id, FakeJob(timeout_s=5.0), backend, store, RetryPolicy(0)).run() is RunStatus.TIMEDOUT
    assert backend.handles[0].timeouts == [5.0]
    assert store.get_attempt(run_id, 0).status is AttemptStatus.TIMEDOUT


def test_cancel_before_the_first_step(store: RunStore) -> None:
    run_id = new_run(store)
    store.transition(run_id, RunStatus.TERMINATING, reason="air cancel")
    backend = FakeBackend([OK])
    controller = make_controller(run_id, FakeJob(), backend, store, RetryPolicy(3))
    assert steps(controller) == [(Phase.ACQUIRE, Phase.DONE, RunStatus.CANCELED)]
    assert store.get_run(run_id).status is RunStatus.CANCELED
    assert backend.held == 0 and backend.reaped == [controller.tag]


def test_cancel_while_queued(store: RunStore) -> None:
    run_id = new_run(store)
    backend, job = FakeBackend([OK], queued=True), FakeJob()
    calls = []

    def queued_note(line: str) -> None:
        calls.append(line)
        if len(calls) == 3:
            store.transition(run_id, RunStatus.TERMINATING, reason="air cancel")

    job.on_wait = queued_note  # type: ignore[method-assign]
    assert make_controller(run_id, job, backend, store, RetryPolicy(0)).run() is RunStatus.CANCELED
    assert store.get_run(run_id).status is RunStatus.CANCELED and store.list_attempts(run_id) == []
    assert backend.held == 0 and len(calls) == 3


def test_cancel_while_running_ends_the_nodes_and_is_not_retried(store: RunStore) -> None:
    run_id = new_run(store)
    backend = FakeBackend([OK], on_wait=lambda _stop: store.transition(run_id, RunStatus.TERMINATING, reason="x"))
    assert make_controller(run_id, FakeJob(), backend, store, RetryPolicy(5)).run() is RunStatus.CANCELED
    assert backend.handles[0].terminated
    assert [a.status for a in store.list_attempts(run_id)] == [AttemptStatus.CANCELED]
    assert backend.released == 1


def test_cancel_checks_are_throttled_by_the_clock(store: RunStore) -> None:
    run_id = new_run(store)
    clock = FakeClock()
    seen: list[bool] = []

    def running(should_stop: Callable[[], bool]) -> None:
        seen.append(should_stop())  # reads the store (RUNNING): no
        store.transition(run_id, RunStatus.TERMINATING, reason="air cancel")
        seen.append(should_stop())  # within cancel_check_s: not read again
        clock.now += 1.5
        seen.append(should_stop())  # read again: canceled

    backend = FakeBackend([OK], on_wait=running)
    controller = make_controller(run_id, FakeJob(), backend, store, RetryPolicy(0), cancel_check_s=1.0, clock=clock)
    assert controller.run() is RunStatus.CANCELED
    assert seen == [False, False, True]


def test_setup_failure_fails_the_attempt_without_starting_nodes(store: RunStore) -> None:
    run_id = new_run(store)
    backend = FakeBackend([OK])
    status = make_controller(run_id, FakeJob(setup_error="pip failed"), backend, store, RetryPolicy(0)).run()
    assert status is RunStatus.FAILED
    attempt = store.get_attempt(run_id, 0)
    assert attempt.failure_class is FailureClass.SETUP and attempt.termination_reason == "pip failed"
    assert backend.handles == [] and backend.released == 1


def test_a_backend_failure_releases_the_capacity_and_raises(store: RunStore) -> None:
    run_id = new_run(store)
    backend = FakeBackend([], start_error=LaunchError("agents gone"))
    with pytest.raises(LaunchError, match="agents gone"):
        make_controller(run_id, FakeJob(), backend, store, RetryPolicy(3)).run()
    assert backend.released == 1  # the caller (supervisor, or the call) records INTERNAL_ERROR


def test_ctrl_c_while_running_records_canceled_and_propagates(store: RunStore) -> None:
    run_id = new_run(store)

    def interrupt(_stop: Callable[[], bool]) -> None:
        raise KeyboardInterrupt

    backend = FakeBackend([OK], on_wait=interrupt)
    with pytest.raises(KeyboardInterrupt):
        make_controller(run_id, FakeJob(), backend, store, RetryPolicy(3)).run()
    run = store.get_run(run_id)
    assert run.status is RunStatus.CANCELED and "user signal" in (run.termination_reason or "")
    assert backend.handles[0].terminated and backend.released == 1
    assert store.get_attempt(run_id, 0).status is AttemptStatus.CANCELED


def test_node_process_is_plain_data() -> None:
    """What crosses the Ray boundary pickles as is (no dicts)."""
    import pickle

    launch = NodeLaunch(0, [ProcessSpec("rank 0", ["python"], {"A": "1"}, Path("/tmp/x.log"))], Path("/tmp/n.log"),
                        files={"payload.pkl": b"x"}, warm_preload=("torch",))
    assert pickle.loads(pickle.dumps(launch)) == launch


def _silent_once(clock: FakeClock, silences: list[Silence], seen: list[bool]) -> Callable[[Callable[[], bool]], None]:
    """The first attempt's nodes go quiet: the handle reports `silences` and the controller is asked."""
    calls = {"n": 0}

    def on_wait(should_stop: Callable[[], bool]) -> None:
        calls["n"] += 1
        if calls["n"] > 1:
            return
        backend_handle = on_wait.handle()  # type: ignore[attr-defined]
        backend_handle.silent = [Silence(0, 0, 5.0)]
        seen.append(should_stop())  # nobody quiet for long: no hang
        backend_handle.silent = silences
        seen.append(should_stop())  # within progress_check_s of the last look: not looked at again
        clock.now += 1.5
        seen.append(should_stop())  # looked at: node 1 is quiet past the hang timeout

    return on_wait


def test_a_silent_node_ends_the_attempt_as_hung_with_stacks_then_it_is_retried(store: RunStore) -> None:
    run_id = new_run(store)
    clock = FakeClock()
    seen: list[bool] = []
    on_wait = _silent_once(clock, [Silence(0, 0, 2.0), Silence(1, 0, 75.0)], seen)
    backend = FakeBackend([OK, OK], on_wait=on_wait)
    on_wait.handle = lambda: backend.handles[-1]  # type: ignore[attr-defined]
    controller = make_controller(run_id, FakeJob(hang_timeout_s=60.0), backend, store, RetryPolicy(1),
                               clock=clock, progress_check_s=1.0)
    assert controller.run() is RunStatus.SUCCESS
    assert seen == [False, False, True]
    first, second = store.list_attempts(run_id)
    assert first.failure_class is FailureClass.HANG and first.status is AttemptStatus.FAILED
    assert (first.termination_reason or "").startswith("Hang: node 1 made no progress for 1m"), first.termination_reason
    assert second.status is AttemptStatus.SUCCESS
    paths = RunPaths(run_id)
    assert paths.stacks(0, "node 1").read_text() == "stacks of node 1 process 0\n"
    assert paths.stacks(0, "node 0").exists()  # every process's stacks, not just the silent one's
    assert '"silent_s": 75.0' in paths.progress(0).read_text()
    assert backend.handles[0].terminated and backend.released == 2


def test_a_hang_with_no_retries_left_fails_the_run_with_a_hang_error(store: RunStore) -> None:
    run_id = new_run(store)
    clock = FakeClock()
    on_wait = _silent_once(clock, [Silence(0, 0, 61.0, stopped=False), Silence(0, 1, 61.0, stopped=True)], [])
    backend = FakeBackend([OK], on_wait=on_wait)
    on_wait.handle = lambda: backend.handles[-1]  # type: ignore[attr-defined]
    controller = make_controller(run_id, FakeJob(hang_timeout_s=60.0), backend, store, RetryPolicy(0), clock=clock)
    assert controller.run() is RunStatus.FAILED
    run = store.get_run(run_id)
    assert run.failure_class is FailureClass.HANG and "(it is stopped)" in (run.termination_reason or "")
    verdict = controller.last_verdict
    assert verdict is not None and verdict.error is not None and type(verdict.error).__name__ == "HangError"
    assert verdict.error.stacks == "stacks of node 0 process 1"  # the stopped one: its peer only waits on it


def test_without_a_hang_timeout_progress_is_noted_but_never_ends_the_attempt(store: RunStore) -> None:
    run_id = new_run(store)
    clock = FakeClock()
    seen: list[bool] = []
    on_wait = _silent_once(clock, [Silence(0, 0, 10_000.0)], seen)
    backend = FakeBackend([OK], on_wait=on_wait)
    on_wait.handle = lambda: backend.handles[-1]  # type: ignore[attr-defined]
    assert make_controller(run_id, FakeJob(), backend, store, RetryPolicy(0), clock=clock).run() is RunStatus.SUCCESS
    assert seen == [False, False, False]
    assert '"silent_s": 10000.0' in RunPaths(run_id).progress(0).read_text()
