"""One MLflow run per attempt (air.tracking): made as it starts (a workload's in the background), linked
in the store and `attempt_<a>/tracking.json` once it exists, sampling the nodes' system metrics, ended once
the attempt's outcome is state: a retried attempt's before WAITING_FOR_RETRY, the last one's after the
run's end state (`air run` and the pages see that at once; this process goes on only to finish MLflow)."""

import dataclasses
import functools
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from air.runs.credentials import door_url
from air.runs.transitions import Change, Phase, RunListener, Transition
from air.store.paths import RunPaths
from air.store.run_store import RunStore
from air.store.states import AttemptStatus
from air.tracking.attempt_tracking import AttemptTracking, node_telemetry
from air.tracking.handle import write_tracking_ref

#: How long a run's process goes on after its end state to end the attempt's MLflow run (uploads included).
TRACKING_END_S = 600.0


class TrackedJob(Protocol):
    """What the listeners need of the controller's job: its log, each attempt's MLflow run (AttemptTracking.off()
    when there is none) and the per-rank logs to attach to it (none for a workload)."""

    num_nodes: int

    def say(self, line: str) -> None: ...

    def tracking(self, attempt: int, warn: Callable[[str], None]) -> AttemptTracking: ...

    def rank_logs(self) -> dict[int, Path]: ...


class TrackingListener(RunListener):
    def __init__(self, job: TrackedJob, store: RunStore) -> None:
        self.job = job
        self.store = store
        self.tracking: AttemptTracking | None = None  # the attempt in progress's
        self._end: Callable[[], None] | None = None

    def node_env(self, t: Transition, env: dict[str, str]) -> dict[str, str]:
        return {**env, **node_telemetry(), **self.tracking.env()} if self.tracking is not None else env

    def on_transition(self, t: Transition) -> None:
        if t.kind is Change.RUN_ENDED:
            self._flush(t.run_id)
        elif t.kind is Change.ATTEMPT_STARTED:
            assert t.attempt is not None and t.log is not None
            index, made = t.attempt, self.job.tracking(t.attempt, t.log)
            self.tracking = made
            made.when_ready(lambda: self._record(t.run_id, index, made))  # (a workload's: in the background)
        elif (tracking := self.tracking) is None:
            return
        elif t.kind is Change.STEP and t.before is Phase.START and t.after is Phase.WAIT:
            assert t.handle is not None and t.allocation is not None
            gpus = None if t.allocation.accelerator.is_cpu else t.allocation.slots_per_node
            # A backend whose nodes sample their own hosts (Ray's agents) hands their samples over instead.
            tracking.start_samplers(gpus, self.job.num_nodes, t.handle.take_system_samples)
        elif t.kind is Change.ATTEMPT_ENDING and t.retry:
            tracking.wait_ready()  # a retried attempt's end is recorded once its MLflow run id is
        elif t.kind is Change.ATTEMPT_ENDED:
            self._flush(t.run_id)  # an earlier attempt's, still pending
            self.tracking = None
            if t.after is None:  # air failed: its caller records the attempt
                tracking.end("FAILED", t.reason)
                return
            status = "FINISHED" if t.after is AttemptStatus.SUCCESS else "KILLED" if t.canceled else "FAILED"
            self._end = functools.partial(tracking.end, status, t.reason, node_logs=t.node_logs,
                                          rank_logs=self.job.rank_logs())
            if t.retry:  # ended before the run waits for its retry
                self._flush(t.run_id)

    def _flush(self, run_id: str) -> None:
        """The ended attempt's MLflow end, in a thread joined for at most TRACKING_END_S (supervisor.log says
        how long when it takes a while). Never raises."""
        end, self._end = self._end, None
        if end is None:
            return

        def run_end() -> None:
            try:
                end()
            except Exception as exc:  # tracking never fails a run
                self.job.say(f"tracking: could not end the attempt's MLflow run: {exc}")

        started = time.monotonic()
        worker = threading.Thread(target=run_end, name="air-mlflow-end", daemon=True)
        worker.start()
        worker.join(TRACKING_END_S)
        took = time.monotonic() - started
        if worker.is_alive():
            self.job.say(f"tracking: the attempt's MLflow run was not ended within {TRACKING_END_S:g} s; left as it is")
        elif took > 1.0:
            self.job.say(f"tracking: the attempt's MLflow run ended {took:.1f} s after the run's end state")
        from air.runs.reconcile import mark_tracking_pending

        if mark_tracking_pending(self.store, run_id):  # given up: `air server` makes it once MLflow is back
            self.job.say("tracking: the run is marked \"tracking pending\": `air server` makes its attempt's "
                         "MLflow run (logs and locally logged metrics included) once its MLflow answers")

    def _record(self, run_id: str, index: int, tracking: AttemptTracking) -> None:
        """Link the attempt to its MLflow run in the store and in `attempt_<a>/tracking.json`."""
        handle = tracking.handle
        if handle is None:
            return
        try:
            self.store.set_mlflow_run_id(run_id, handle.run_id, attempt=index)
            door = door_url()  # links (`air get run`, pages) go through the server's door, never to loopback
            write_tracking_ref(RunPaths(run_id).tracking(index),
                               dataclasses.replace(handle, tracking_uri=door) if door else handle)
        except Exception as exc:  # tracking never fails a run
            tracking.warn(f"tracking: {exc}")
