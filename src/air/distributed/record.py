"""A local `@distributed` call as a run in the run store (kind `call`), recorded off the caller's path.

`air list runs`, `air get run`, `air logs` and `air cancel` see every call, but the call must not get
slower for it: one background thread per call opens the store, records the run (PENDING → RUNNING, the
caller's pid as its supervisor, one attempt) while the ranks start, watches for `air cancel`, and writes
the end (SUCCESS, or FAILED/TIMEDOUT/CANCELED with the failing rank's error) after the call returned.
The thread is not a daemon, so the interpreter waits for that last write before it exits; a caller that
is SIGKILLed leaves the run RUNNING, and the next `air` command's reconcile ends it (its "supervisor",
the caller, is gone). A broken store is one warning line: recording never fails a call.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any, NamedTuple

from air.constants import CANCEL_CHECK_S
from air.runs.paths import process_tag  # light: the store and the states load in the recorder thread


class CallEnd(NamedTuple):
    """How a call ended, as the run store records it (a RunStatus and FailureClass by value)."""

    status: str
    reason: str | None = None
    failure_class: str | None = None
    mlflow_run_id: str | None = None
    #: The MLflow experiment the call's run was logged to (air shows the call under it).
    experiment: str | None = None


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def end_of(exc: BaseException) -> CallEnd:
    """The run's end for a call that raised `exc`: the failing rank's error as its reason."""
    from air.errors import LocalExecutionTimeoutError, SerializationError

    if isinstance(exc, KeyboardInterrupt):
        return CallEnd("CANCELED", "Canceled by user signal (Ctrl-C in the caller).", "CANCEL")
    if isinstance(exc, LocalExecutionTimeoutError):
        return CallEnd("TIMEDOUT", _first_line(str(exc))[:500], "TIMEOUT")
    message = _first_line(str(exc))
    rank = getattr(exc, "air_rank", None)
    if rank is not None and not message.lower().startswith(f"rank {rank}"):
        reason = f"Rank {rank}: {type(exc).__name__}" + (f": {message}" if message else "")
    else:
        reason = message or type(exc).__name__
    klass = "SETUP" if isinstance(exc, SerializationError) else "USER_CODE"
    return CallEnd("FAILED", reason[:500], klass)


class LocalCallRecord:
    """The run-store side of one local call, written by a background thread (see the module docstring)."""

    def __init__(
        self, run_id: str, *, name: str, accelerator_type: str, world_size: int, experiment: str | None = None
    ) -> None:
        self.run_id = run_id
        self._name = name
        self._accelerator_type = accelerator_type
        self._world_size = world_size
        self._experiment = experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "air-distributed"
        self._pid = os.getpid()
        self._outcome: CallEnd | None = None
        self._ended = threading.Event()
        #: Set once `air cancel` asked for the call and the recorder ended its ranks.
        self.canceled = threading.Event()
        self._thread = threading.Thread(target=self._work, name=f"air-call-record-{run_id}", daemon=False)
        self._thread.start()

    def finish(self, end: CallEnd) -> None:
        """Hand the call's end to the recorder and return at once (the write happens in the background)."""
        self._outcome = end
        self._ended.set()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the recorder (tests, and callers that want the record written now)."""
        self._thread.join(timeout)

    # -- the recorder thread ------------------------------------------------------------------------

    def _warn(self, exc: BaseException) -> None:
        try:
            sys.stderr.write(
                f"[air] run store: {type(exc).__name__}: {exc} (the call {self.run_id} is not recorded)\n"
            )
        except (ValueError, OSError):
            pass

    def _work(self) -> None:
        try:
            from air.runs.store import RunStore

            store = RunStore()
            self._start(store)
        except Exception as exc:  # noqa: BLE001 - recording never fails a call
            self._warn(exc)
            return
        try:
            end = self._wait(store)
            self._end(store, end)
        except Exception as exc:  # noqa: BLE001
            self._warn(exc)
        finally:
            store.close()

    def _start(self, store: Any) -> None:
        from air.runs.states import RunStatus

        store.create_run(
            experiment=self._experiment,
            accelerator_type=self._accelerator_type,
            num_accelerators=self._world_size,
            num_nodes=1,
            backend="local",
            kind="call",
            run_name=self._name,
            run_id=self.run_id,
        )
        store.set_supervisor(self.run_id, self._pid)
        store.start_attempt(self.run_id)
        store.transition(self.run_id, RunStatus.RUNNING, expected_from=RunStatus.PENDING)

    def _wait(self, store: Any) -> CallEnd:
        """The call's end; meanwhile, end the ranks if `air cancel` moved the run to TERMINATING."""
        from air.runs.states import RunStatus

        while not self._ended.wait(CANCEL_CHECK_S):
            if not self.canceled.is_set() and store.get_run(self.run_id).status is RunStatus.TERMINATING:
                from air.launcher import reap_tag

                self.canceled.set()
                reap_tag(process_tag(self.run_id))  # the caller's launch then sees its ranks gone
        assert self._outcome is not None
        return self._outcome

    def _end(self, store: Any, end: CallEnd) -> None:
        from air.runs.states import FailureClass, IllegalTransitionError, RunStatus

        if end.mlflow_run_id:
            store.set_mlflow_run_id(self.run_id, end.mlflow_run_id, attempt=0, experiment=end.experiment)
        run = store.get_run(self.run_id)
        if run.is_terminal:
            return  # `air cancel` gave up waiting and ended it itself
        status, reason = RunStatus(end.status), end.reason
        klass = FailureClass(end.failure_class) if end.failure_class else None
        if run.status is RunStatus.TERMINATING and status is not RunStatus.SUCCESS:
            status, reason, klass = (
                RunStatus.CANCELED,
                run.termination_reason or "Canceled by the user",
                FailureClass.CANCEL,
            )
        if status is RunStatus.CANCELED and run.status is RunStatus.RUNNING:
            store.transition(
                self.run_id,
                RunStatus.TERMINATING,
                reason=reason,
                failure_class=klass,
                expected_from=RunStatus.RUNNING,
            )
        try:
            store.transition(self.run_id, status, reason=reason, failure_class=klass)
        except IllegalTransitionError:
            pass  # ended by someone else meanwhile


__all__ = ["CallEnd", "LocalCallRecord", "end_of"]
