"""The run controller: drives one run, a workload or a `@distributed` call (local or `remote=True`), to a
terminal state.

Modeled on Ray Train V2's controller: a loop of `step()`, each returning a `Transition` from one phase
to the next::

    ACQUIRE --capacity held--> START --nodes started--> WAIT --nodes ended--> FINISH --retry--> ACQUIRE
       |                         | setup failed                                  |
       +--canceled--> DONE       +------------------------------------------> FINISH --end--> DONE

FINISH is the one place an attempt's outcome becomes state (`_finish_attempt`): one `RetryPolicy`
decides retry or end. What differs between a workload and a call (how nodes are built, how an outcome is
judged) is the `RunJob`'s. Every state change is published as a typed `Transition` to the listeners its
builder passes (air/runs/transitions.py: MLflow tracking, run credentials, progress files, status lines).

The same controller runs detached (`air run`'s supervisor process, air/runs/supervisor.py) and in the
caller's process (a blocking call, local or `remote=True`, air/distributed/remote.py). Every state change is a
compare-and-set in the run store; a cancel (`air cancel` moves the run to TERMINATING) is noticed at
every step, and whatever happens, the allocation is released and no node process is left.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import signal
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from air.accelerators import AcceleratorType
from air.backends.base import Allocation, AttemptHandle, AttemptOutcome, Backend, NodeLaunch, ProcLineCallback
from air.constants import PROGRESS_CHECK_S
from air.errors import HangError, NotFoundError
from air.files import atomic_write_text
from air.launcher.progress import find_hang, quiet_for
from air.launcher.stacks import collect as collect_stacks
from air.runs.reasons import rendezvous_hint
from air.runs.transitions import Change, Phase, RunListener, Transition
from air.store.paths import RunPaths, process_tag
from air.store.run_store import RunStore
from air.store.states import (
    AttemptStatus,
    FailureClass,
    RetryDecision,
    RetryPolicy,
    RunStatus,
    StatusConflictError,
)


class SetupFailure(Exception):
    """Raised by a job while it prepares an attempt (environment, version check): the attempt fails
    with FailureClass.SETUP and `message` as its reason. `error` is what an in-process caller raises."""

    def __init__(self, message: str, error: BaseException | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.error = error


@dataclass(frozen=True)
class AttemptVerdict:
    """What an attempt came to, judged by the job: success (with the call's values) or a failure with
    its reason and class, and the exception an in-process caller raises for it."""

    ok: bool
    reason: str | None = None
    failure_class: FailureClass | None = None
    exit_code: int | None = None
    signal: int | None = None
    error: BaseException | None = None
    values: Any = None

    @classmethod
    def failed(cls, reason: str, failure_class: FailureClass, error: BaseException | None = None) -> AttemptVerdict:
        return cls(False, reason, failure_class, error=error)


class CallerStopped(KeyboardInterrupt):
    """A signal (SIGTERM, SIGHUP, Ctrl-C) stopped the process that drives its run in-process (a call's
    caller): a cancel by the user, not air failing, so the run ends CANCELED with the signal named."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        name = signal.Signals(signum).name
        self.reason = f"Canceled by user signal: the caller was stopped by {name}" + (
            " (Ctrl-C)." if signum == signal.SIGINT else ".")
        super().__init__(self.reason)


class RunJob(Protocol):
    """The workload's or the call's side of a run: what the controller cannot know by itself."""

    accelerator: AcceleratorType
    num_nodes: int
    timeout_s: float | None
    #: Seconds any node process may go without progress before the attempt is ended as hung (None: off).
    hang_timeout_s: float | None

    def process_label(self, node: int, process: int) -> str:
        """How reasons and files name one node process: "node 1" (a workload), "rank 3" (a call)."""

    @property
    def on_line(self) -> ProcLineCallback | None:
        """Each process line as it arrives (a call prints them); None: the logs are enough."""

    def say(self, line: str) -> None:
        """One line of the controller's own log (supervisor.log; a call's debug log)."""

    def on_wait(self, line: str) -> None:
        """A line while the run waits for capacity (supervisor.log, or the caller's stderr)."""

    def attempt_log(self, attempt: int, node_logs: dict[int, Path]) -> Callable[[str], None]:
        """Where air's own lines about this attempt go (setup, warnings)."""

    def launches(self, attempt: int, allocation: Allocation, node_logs: dict[int, Path],
                 tracking_env: dict[str, str], air_log: Callable[[str], None]) -> AbstractContextManager[list[NodeLaunch]]:
        """The attempt's node launches, held (an environment in use) until the nodes ended. Raises
        SetupFailure where the attempt cannot start."""

    def judge(self, attempt: int, handle: AttemptHandle, outcome: AttemptOutcome,
              node_logs: dict[int, Path]) -> AttemptVerdict:
        """Turn an outcome into a verdict (read tails, fetch rank outcomes...); a stopped one (a cancel)
        is a FailureClass.CANCEL failure."""


@dataclass
class _Attempt:
    """What the controller holds for the attempt in progress."""

    index: int
    node_logs: dict[int, Path]
    held: contextlib.ExitStack
    handle: AttemptHandle | None = None
    outcome: AttemptOutcome | None = None
    verdict: AttemptVerdict | None = None
    hang: AttemptVerdict | None = None  # set by the hang check; wins over how the nodes then ended
    #: The nodes as launched (their processes and environments): a hang reason reads what a node was told.
    launches: list[NodeLaunch] = dataclasses.field(default_factory=list)
    #: The CRITICAL run that asked for this attempt's slots (runs/preemption.py), once seen; its nodes are
    #: then ended and the run goes back to the queue, unless they had all succeeded already.
    preempted_by: str | None = None
    next_progress_check: float = 0.0
    #: Nodes seen with a running process, and when each was first seen with none (its command ended
    #: while others still ran: "node 0 ended; node 1 still running").
    ended_at: dict[int, float] = dataclasses.field(default_factory=dict)


class RunController:
    """Drives one run through `step()` until DONE (see the module docstring)."""

    def __init__(self, run_id: str, job: RunJob, backend: Backend, store: RunStore, policy: RetryPolicy, *,
                 cancel_check_s: float = 0.0, clock: Callable[[], float] = time.monotonic,
                 progress_check_s: float = PROGRESS_CHECK_S, listeners: Sequence[RunListener] = ()) -> None:
        self.run_id = run_id
        self.job = job
        self.backend = backend
        self.store = store
        self.policy = policy
        self.paths = RunPaths(run_id)
        self.tag = process_tag(run_id)
        self.phase = Phase.ACQUIRE
        self.status: RunStatus | None = None
        self.last_verdict: AttemptVerdict | None = None
        self._cancel_check_s = cancel_check_s
        self._progress_check_s = progress_check_s
        self._clock = clock
        self._next_cancel_check = 0.0
        self._cancel_seen = False
        self._preempt_seen: str | None = None
        self._allocation: Allocation | None = None
        self._attempt: _Attempt | None = None
        self.listeners = list(listeners)

    # -- the loop -----------------------------------------------------------------------------------
    def run(self) -> RunStatus:
        """Step until DONE; on any exception (Ctrl-C included) nothing is left running or held."""
        try:
            while self.phase is not Phase.DONE:
                self.step()
        except KeyboardInterrupt as exc:  # Ctrl-C, or a signal that stopped the caller (CallerStopped)
            self._interrupted(exc.reason if isinstance(exc, CallerStopped) else "Canceled by user signal.")
            raise
        except BaseException:
            self._abandon()
            raise
        finally:
            self._publish(Transition(Change.RUN_ENDED, self.run_id, status=self.status))
        assert self.status is not None
        return self.status

    def step(self) -> Transition:
        before = self.phase
        if before is Phase.ACQUIRE:
            self.phase = self._acquire()
        elif before is Phase.START:
            self.phase = self._start()
        elif before is Phase.WAIT:
            self.phase = self._wait()
        elif before is Phase.FINISH:
            self.phase = self._finish()
        at = self._attempt
        return self._publish(Transition(Change.STEP, self.run_id, before, self.phase, self.status,
                                        None if at is None else at.index, handle=None if at is None else at.handle,
                                        allocation=self._allocation))

    def _publish(self, t: Transition) -> Transition:
        """Hand a state change to every listener, in order."""
        for listener in self.listeners:
            listener.on_transition(t)
        return t

    # -- phases -------------------------------------------------------------------------------------
    def _acquire(self) -> Phase:
        # A workload is queued by `air run` and its supervisor started once admitted (runs/admission.py).
        queued = self.store.get_run(self.run_id).status is RunStatus.QUEUED
        if not queued and not self._move(RunStatus.QUEUED, {RunStatus.PENDING, RunStatus.WAITING_FOR_RETRY}):
            return self._end_canceled()
        allocation = self.backend.acquire(self.run_id, self.job.accelerator, self.job.num_nodes,
                                          should_stop=self._stop_queue, on_wait=self.job.on_wait)
        if allocation is None:
            return self._end_canceled()
        self._allocation = allocation
        self.job.say("capacity acquired: " + "; ".join(
            f"node {n}: {allocation.accelerator.kind} {','.join(slots)}"
            for n, slots in enumerate(allocation.slots_per_node)))
        return Phase.START

    def _start(self) -> Phase:
        assert self._allocation is not None
        if not self._move(RunStatus.RUNNING, {RunStatus.QUEUED}):
            self._release()
            return self._end_canceled()
        index = self.store.start_attempt(self.run_id).index
        self.paths.create_attempt(index)
        node_logs = {n: self.paths.node_log(index, n) for n in range(self.job.num_nodes)}
        for path in node_logs.values():
            path.touch()
        air_log = self.job.attempt_log(index, node_logs)
        started = self._publish(Transition(Change.ATTEMPT_STARTED, self.run_id, after=AttemptStatus.RUNNING,
                                           attempt=index, node_logs=node_logs, log=air_log))
        attempt = self._attempt = _Attempt(index, node_logs, contextlib.ExitStack())
        try:
            node_env: dict[str, str] = {}
            for listener in self.listeners:
                node_env = listener.node_env(started, node_env)
            launches = attempt.held.enter_context(self.job.launches(index, self._allocation, node_logs,
                                                                    node_env, air_log))
            self.job.say(f"attempt {index}: starting {len(launches)} node(s)")
            attempt.launches = list(launches)
            attempt.handle = self.backend.start(self._allocation, launches, tag=self.tag, on_line=self.job.on_line)
        except SetupFailure as exc:
            attempt.verdict = AttemptVerdict.failed(exc.message, FailureClass.SETUP, exc.error)
            return Phase.FINISH
        return Phase.WAIT

    def _wait(self) -> Phase:
        attempt = self._attempt
        assert attempt is not None and attempt.handle is not None
        handle = attempt.handle

        def should_stop() -> bool:
            return self.cancel_requested() or self._preempted(attempt) or self._hung(attempt, handle)

        attempt.outcome = handle.wait(timeout_s=self.job.timeout_s, should_stop=should_stop)
        attempt.held.close()  # the environment is free once the nodes ended
        return Phase.FINISH

    def _hung(self, attempt: _Attempt, handle: AttemptHandle) -> bool:
        """Every `progress_check_s`: note each node process's progress (`air get run` shows it) and, with
        a hang timeout, ask `find_hang` (the one place that decides). A hang saves every process's
        stacks in the attempt's folder, then ends the attempt (True) as FailureClass.HANG."""
        if attempt.hang is not None:
            return True
        now = self._clock()
        if now < attempt.next_progress_check:
            return False
        attempt.next_progress_check = now + self._progress_check_s
        try:
            silences = handle.silences()
        except Exception as exc:  # a failed look never ends a run
            self.job.say(f"progress: could not read it: {exc}")
            return False
        label = self.job.process_label
        running = {s.node for s in silences}
        try:
            ended = handle.ended_nodes()
        except Exception:  # a failed look never ends a run
            ended = set()
        for node in ended - running:
            attempt.ended_at.setdefault(node, time.time())
        self._publish(Transition(Change.PROGRESS, self.run_id, attempt=attempt.index, processes=tuple(
            {"name": label(s.node, s.process), "node": s.node, "process": s.process,
             "silent_s": round(s.silent_s, 1), "stopped": s.stopped} for s in silences),
            ended=tuple({"node": n, "ended_at": t} for n, t in sorted(attempt.ended_at.items()))))
        hang = find_hang(silences, self.job.hang_timeout_s)
        if hang is None:
            return False
        stacks_of = {}
        texts = collect_stacks({label(s.node, s.process): functools.partial(handle.stacks, s.node, s.process)
                                for s in silences})  # all at once, under one deadline
        for name, text in texts.items():
            path = self.paths.stacks(attempt.index, name)
            atomic_write_text(path, text + "\n")
            stacks_of[name] = (text, path)
        name = label(hang.node, hang.process)
        text, path = stacks_of[name]
        limit = self.job.hang_timeout_s or 0.0
        launch = next((n for n in attempt.launches if n.node_rank == hang.node), None)
        hint = None if launch is None or not launch.processes else rendezvous_hint(
            len(launch.processes), dict(launch.processes[0].env), text)
        reason = (f"Hang: {name} made no progress for {quiet_for(hang.silent_s)}"
                  f"{' (it is stopped)' if hang.stopped else ''}: no output, heartbeat or report within the hang "
                  f"timeout of {limit:g} s{'; ' + hint if hint else ''}. Stacks of every process: {path.parent}")
        self.job.say(reason)
        rank = int(name.split()[1]) if name.startswith("rank ") else None
        error = HangError(reason, rank=rank, node=hang.node,
                          silent_s=hang.silent_s, stacks=text, stacks_path=str(path),
                          hint="Call air.runtime.heartbeat() in long silent steps, or raise the hang timeout.")
        attempt.hang = AttemptVerdict.failed(reason, FailureClass.HANG, error)
        return True

    def _preempted(self, attempt: _Attempt) -> bool:
        """A CRITICAL run asked for this attempt's slots (seen by `cancel_requested`'s read of the run)."""
        if attempt.preempted_by is None and self._preempt_seen is not None:
            try:
                waiting = self.store.get_run(self._preempt_seen).status is RunStatus.QUEUED
            except NotFoundError:
                waiting = False
            if not waiting:  # the CRITICAL run was canceled (or started) meanwhile: keep running
                self._clear_preemption()
                return False
            attempt.preempted_by = self._preempt_seen
            self.job.say(f"attempt {attempt.index}: preempted by CRITICAL run {attempt.preempted_by}; ending it")
        return attempt.preempted_by is not None

    def _finish(self) -> Phase:
        attempt = self._attempt
        assert attempt is not None
        try:
            verdict = attempt.verdict or attempt.hang
            if (verdict is None and attempt.preempted_by is not None and attempt.outcome is not None
                    and not attempt.outcome.ok and not self.cancel_requested(force=True)):
                requeued = self._requeue_preempted(attempt, attempt.preempted_by)
                self.status = None if requeued else RunStatus.CANCELED
                return Phase.ACQUIRE if requeued else Phase.DONE
            self._clear_preemption()  # a mark (seen or not) is void: the attempt ended by itself first
            if verdict is None:
                assert attempt.outcome is not None and attempt.handle is not None
                verdict = self.job.judge(attempt.index, attempt.handle, attempt.outcome, attempt.node_logs)
            self.last_verdict = verdict
            status = self._finish_attempt(attempt, verdict)
        finally:
            attempt.held.close()
            self._attempt = None
            self._release()
        if status is None:
            return Phase.ACQUIRE
        self.status = status
        return Phase.DONE

    def _finish_attempt(self, attempt: _Attempt, verdict: AttemptVerdict) -> RunStatus | None:
        """The one place an attempt's outcome becomes state. Returns the run's end state, or None to retry."""
        index = attempt.index
        # The run's last attempt (success, cancel, final failure) ends it at once; its listeners finish their
        # part after the end state (RUN_ENDED). A retried attempt's are done before WAITING_FOR_RETRY.
        if verdict.ok:
            self.store.finish_attempt(self.run_id, index, AttemptStatus.SUCCESS)
            self._attempt_ended(attempt, AttemptStatus.SUCCESS)
            self._transition(RunStatus.SUCCESS, expected_from={RunStatus.RUNNING, RunStatus.TERMINATING})
            return RunStatus.SUCCESS
        assert verdict.reason is not None and verdict.failure_class is not None
        reason, failure_class = verdict.reason, verdict.failure_class
        canceled = failure_class is FailureClass.CANCEL or (
            attempt.outcome is not None and attempt.outcome.stopped and attempt.hang is None)
        self.job.say(f"attempt {index} ended: {reason} [{failure_class}]")
        # Preempted attempts are not retries: the budget counts the others.
        decision = None if canceled else self.policy.decide(
            index - self.store.get_run(self.run_id).preemptions, failure_class)
        retry = decision is not None and decision.decision is RetryDecision.RETRY
        self._publish(Transition(Change.ATTEMPT_ENDING, self.run_id, attempt=index, retry=retry))
        self.store.finish_attempt(self.run_id, index, failure_class.attempt_status, reason=reason,
                                  failure_class=failure_class, exit_code=verdict.exit_code, signal=verdict.signal)
        if canceled or decision is None:
            self._attempt_ended(attempt, failure_class.attempt_status, reason, canceled=True)
            self._to_canceled(reason, failure_class)
            return RunStatus.CANCELED
        retry = retry and not self.cancel_requested(force=True)
        self._attempt_ended(attempt, failure_class.attempt_status, reason, retry=retry)
        if retry:
            try:
                self._transition(RunStatus.WAITING_FOR_RETRY, reason=f"{reason}. {decision.message}",
                                 failure_class=failure_class, expected_from={RunStatus.RUNNING})
            except StatusConflictError:
                self._end_canceled()
                return RunStatus.CANCELED
            self.job.say(decision.message)
            return None
        if self.cancel_requested(force=True):
            self._end_canceled()
            return RunStatus.CANCELED
        final = decision.final_status or failure_class.run_status
        self._transition(final, reason=reason, failure_class=failure_class)
        return final

    def _attempt_ended(self, attempt: _Attempt, status: AttemptStatus | None, reason: str | None = None, *,
                       canceled: bool = False, retry: bool = False) -> None:
        self._publish(Transition(Change.ATTEMPT_ENDED, self.run_id, after=status, attempt=attempt.index, reason=reason,
                                 canceled=canceled, retry=retry, node_logs=attempt.node_logs))

    def _requeue_preempted(self, attempt: _Attempt, by: str) -> bool:
        """The attempt was ended for a CRITICAL run: record it PREEMPTED (not a failure) and put the run
        back in the queue at its old place (through WAITING_FOR_RETRY, as a retry goes, but counted as a
        preemption, not a retry). False when a cancel got there first (the run is then CANCELED)."""
        from air.store.preemption import requeued

        reason = (f"Preempted by CRITICAL run {by}: back in the queue at its place; it resumes from "
                  "AIR_CHECKPOINT_DIR (not counted against max_retries)")
        self.job.say(f"attempt {attempt.index} ended: {reason}")
        self._publish(Transition(Change.ATTEMPT_ENDING, self.run_id, attempt=attempt.index, retry=True))
        self.store.finish_attempt(self.run_id, attempt.index, AttemptStatus.PREEMPTED, reason=reason)
        self._attempt_ended(attempt, AttemptStatus.PREEMPTED, reason, canceled=True, retry=True)
        try:
            self._transition(RunStatus.WAITING_FOR_RETRY, reason=reason, expected_from={RunStatus.RUNNING})
        except StatusConflictError:
            self._end_canceled()
            return False
        with self.store.writer() as conn:
            requeued(conn, self.run_id)
        self._preempt_seen = None
        return True

    def _clear_preemption(self) -> None:
        from air.store.preemption import clear_request

        with self.store.writer() as conn:
            clear_request(conn, self.run_id)
        self._preempt_seen = None

    # -- cancel -------------------------------------------------------------------------------------
    def cancel_requested(self, force: bool = False) -> bool:
        """The run was asked to end (`air cancel` moved it to TERMINATING, or ended it while queued).
        Read from the store at most every `cancel_check_s` unless `force`."""
        if self._cancel_seen:
            return True
        now = self._clock()
        if not force and now < self._next_cancel_check:
            return False
        self._next_cancel_check = now + self._cancel_check_s
        run = self.store.get_run(self.run_id)
        self._cancel_seen = run.status in (RunStatus.TERMINATING, RunStatus.CANCELED)
        self._preempt_seen = run.preempted_by if run.status is RunStatus.RUNNING else None
        return self._cancel_seen

    def _stop_queue(self) -> bool:
        try:
            return self.cancel_requested()
        except Exception:  # the store is gone: stop waiting
            return True

    def _move(self, new: RunStatus, expected: set[RunStatus]) -> bool:
        """Compare-and-set; False when a cancel got there first (the run is TERMINATING or CANCELED)."""
        try:
            self._transition(new, expected_from=expected)
            return True
        except StatusConflictError:
            if self.store.get_run(self.run_id).status in (RunStatus.TERMINATING, RunStatus.CANCELED):
                self._cancel_seen = True
                return False
            raise

    def _end_canceled(self) -> Phase:
        self.backend.reap(self.tag)
        self._to_canceled("Canceled by the user", FailureClass.CANCEL)
        self.status = RunStatus.CANCELED
        return Phase.DONE

    def _to_canceled(self, reason: str, failure_class: FailureClass) -> None:
        run = self.store.get_run(self.run_id)
        if run.status.is_terminal():
            return
        if run.status is RunStatus.TERMINATING and run.termination_reason:
            reason = run.termination_reason  # the cancel's own reason names who asked ("Canceled by alice")
        if run.status is RunStatus.RUNNING:  # processes existed: cancel goes through TERMINATING
            self._transition(RunStatus.TERMINATING, reason=reason)
        self._transition(RunStatus.CANCELED, reason=reason, failure_class=failure_class)

    def _transition(self, new: RunStatus, reason: str | None = None, failure_class: FailureClass | None = None,
                    expected_from: set[RunStatus] | None = None) -> None:
        """Write the run's new status (a compare-and-set with `expected_from`) and publish it."""
        self.store.transition(self.run_id, new, reason=reason, failure_class=failure_class, expected_from=expected_from)
        self._publish(Transition(Change.RUN, self.run_id, after=new, reason=reason))

    def _interrupted(self, reason: str) -> None:
        """Ctrl-C in an in-process run: end every node, record the attempt and the run CANCELED."""
        attempt, self._attempt = self._attempt, None
        try:
            if attempt is not None:
                if attempt.handle is not None:
                    attempt.handle.terminate()
                attempt.held.close()
                self.store.finish_attempt(self.run_id, attempt.index, FailureClass.CANCEL.attempt_status,
                                          reason=reason, failure_class=FailureClass.CANCEL)
                self._attempt_ended(attempt, FailureClass.CANCEL.attempt_status, reason, canceled=True)
            self._to_canceled(reason, FailureClass.CANCEL)
            self.status = RunStatus.CANCELED
        finally:
            self._release()
            self.phase = Phase.DONE

    def _abandon(self) -> None:
        """An exception escaped a step: end the attempt's processes and give the capacity back (the
        caller records why: the supervisor as INTERNAL_ERROR)."""
        attempt, self._attempt = self._attempt, None
        try:
            if attempt is not None:
                if attempt.handle is not None:
                    attempt.handle.terminate()
                attempt.held.close()
                self._attempt_ended(attempt, None, "air failed while running the attempt")
        finally:
            self._release()

    # -- helpers ------------------------------------------------------------------------------------
    def _release(self) -> None:
        allocation, self._allocation = self._allocation, None
        if allocation is not None:
            self.backend.release(allocation)

