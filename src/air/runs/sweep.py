"""`for_each` sweeps: a parent run whose supervisor starts one ordinary child run per item.

The parent is created by `air run` (or `air server`) like any run, but not queued (it holds no slots):
runs.submit starts its supervisor at once, which sees the plan's `sweep` and runs a `SweepJob` instead
of attempts. The SweepJob records the tasks (table `sweep_tasks`, sweep_tasks.py), submits children through
the same path as `air run` (runs.submit: queued in the same slot ledger, admitted by the same loop, run by
the same supervisor; they link the parent's code snapshot, nothing is copied again), keeps at most
`max_concurrent` of them active, and waits. Each child gets its item merged over the workload's
`parameters` (HYPERPARAMETERS_PATH), AIR_SWEEP_INDEX / AIR_SWEEP_RUN_ID, and MLflow runs nested under the
parent's (`mlflow.parentRunId`).

The parent holds no slots. It ends SUCCESS only if every child did; FAILED (with the failed tasks named)
otherwise; a cancel of the parent (TERMINATING) cancels every active child, then the parent.

    PENDING -> RUNNING --all children ended--> SUCCESS | FAILED
                  | canceled: children canceled -> CANCELED
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from typing import TYPE_CHECKING

from air.log import configure_file
from air.runs.cancel import cancel_sweep_children
from air.runs.run_backend import make_backend
from air.runs.submit import Prepared, submit
from air.runs.sweep_tasks import SweepTask, child_run, list_tasks, record_tasks, set_child
from air.settings import AIR_MLFLOW_DOOR, AIR_SWEEP_INDEX, AIR_SWEEP_RUN_ID
from air.store.paths import RunPaths
from air.store.run_store import Run, RunStore
from air.store.states import FailureClass, RunStatus, StatusConflictError
from air.tracking.attempt_tracking import AttemptTracking
from air.workload.plan import RunPlan
from air.workload.sweep_spec import merge_parameters

if TYPE_CHECKING:
    from air.workload.spec import WorkloadSpec

_log = logging.getLogger("air.sweep")

#: How often the parent's supervisor looks at its children and its own status.
SWEEP_POLL_S = 0.5


class SweepJob:
    """Drives a sweep's parent run (see the module docstring). `poll_s` is injectable for tests."""

    def __init__(self, run_id: str, store: RunStore, *, poll_s: float = SWEEP_POLL_S) -> None:
        self.run_id = run_id
        self.store = store
        self.poll_s = poll_s
        self.plan = RunPlan.from_json(RunPaths(run_id).submission.read_text())
        assert self.plan.sweep is not None, "SweepJob needs a plan with a sweep"
        self.items: list[dict[str, object]] = list(self.plan.sweep["items"])
        self.max_concurrent: int = int(self.plan.sweep.get("max_concurrent") or len(self.items))
        self.tracking: AttemptTracking | None = None
        #: Makes the sweep's own MLflow run beside the children (its MLflow import, a server's MLflow that
        #: is still starting): children are submitted at once, and one made before the parent's run exists
        #: finds its id in the store when it makes its own run (workload_job._then_nest_under_sweep).
        self._tracking_thread = threading.Thread(target=self._start_tracking, name="air-sweep-mlflow", daemon=True)

    def run(self) -> RunStatus:
        """Submit and wait on the children until all ended (or the parent is canceled); the final status."""
        self.store.set_supervisor(self.run_id, os.getpid())
        record_tasks(self.store, self.run_id, self.items)
        _log.info("sweep %s: %d task(s), at most %d at once", self.run_id, len(self.items), self.max_concurrent)
        try:
            self.store.transition(self.run_id, RunStatus.RUNNING, expected_from=RunStatus.PENDING)
        except StatusConflictError:
            return self._cancel()
        self._tracking_thread.start()
        try:
            while True:
                if self._canceled():
                    return self._cancel()
                tasks = list_tasks(self.store, self.run_id)
                children = {t.index: child_run(self.store, t.child_run_id) for t in tasks}
                active = [i for i, c in children.items() if c is not None and not c.status.is_terminal()]
                waiting = [t for t in tasks if t.child_run_id is None]
                for task in waiting[: max(0, self.max_concurrent - len(active))]:
                    if self._canceled():
                        return self._cancel()
                    self._submit_child(task)
                if not waiting and not active:
                    return self._finish(tasks, children)
                time.sleep(self.poll_s)
        except BaseException:
            self._cancel_children("The sweep's supervisor failed")
            self._end_tracking("FAILED", "air failed while running the sweep")
            raise

    # -- children -----------------------------------------------------------------------------------
    def _submit_child(self, task: SweepTask) -> None:
        parent = self.store.get_run(self.run_id)
        suffix = f"-{task.index}"
        run_name = self.plan.run_name[: 100 - len(suffix)] + suffix
        parameters = merge_parameters(self.plan.parameters, task.item)
        plan = dataclasses.replace(
            self.plan, sweep=None, parameters=parameters, run_name=run_name,
            env_variables={**self.plan.env_variables, AIR_SWEEP_INDEX: str(task.index), AIR_SWEEP_RUN_ID: self.run_id},
            mlflow_parent_run_id=self._parent_mlflow_run_id(), sweep_run_id=self.run_id,
            run_id=None, command_path=None, parameters_path=None)
        spec = _child_spec(parent.spec_yaml, parameters, run_name)
        prepared = Prepared(spec, plan, make_backend(plan, self.store), None, parent.pool)
        # Queued like any `air run`: the admission loop starts its supervisor when the ledger lets it in.
        child, _existing = submit(prepared, idempotency_key=f"sweep:{self.run_id}:{task.index}", store=self.store,
                                  user=parent.user)
        set_child(self.store, self.run_id, task.index, child.id)
        _log.info("sweep %s: task %d (%s) is run %s", self.run_id, task.index, json.dumps(task.item, default=str),
                  child.id)

    def _cancel_children(self, reason: str) -> None:
        for child, done in cancel_sweep_children(self.store, self.run_id, reason).items():
            _log.info("sweep %s: child %s %s", self.run_id, child, done.value)

    # -- the parent's end ---------------------------------------------------------------------------
    def _canceled(self) -> bool:
        return self.store.get_run(self.run_id).status in (RunStatus.TERMINATING, RunStatus.CANCELED)

    def _cancel(self) -> RunStatus:
        parent = self.store.get_run(self.run_id)
        reason = parent.termination_reason or "Canceled by the user"
        self._cancel_children(reason)
        self._end_tracking("KILLED", reason)
        parent = self.store.get_run(self.run_id)
        if not parent.is_terminal:
            if parent.status is RunStatus.RUNNING:
                self.store.transition(self.run_id, RunStatus.TERMINATING, reason=reason)
            try:
                self.store.transition(self.run_id, RunStatus.CANCELED, reason=reason, failure_class=FailureClass.CANCEL)
            except StatusConflictError:
                pass
        _log.info("sweep %s: canceled", self.run_id)
        return self.store.get_run(self.run_id).status

    def _finish(self, tasks: list[SweepTask], children: dict[int, Run | None]) -> RunStatus:
        failed = [(t, children[t.index]) for t in tasks
                  if (c := children[t.index]) is None or c.status is not RunStatus.SUCCESS]
        if not failed:
            new, reason, failure_class = RunStatus.SUCCESS, None, None
        else:
            first, child = failed[0]
            what = (f"{child.status.value}: {child.termination_reason or 'no reason recorded'}" if child is not None
                    else "its run is gone")
            reason = (f"{len(failed)} of {len(tasks)} sweep task(s) did not succeed (tasks "
                      f"{', '.join(str(t.index) for t, _ in failed)}); the first, task {first.index} "
                      f"(run {first.child_run_id}), {what}")
            new, failure_class = RunStatus.FAILED, (child.failure_class if child is not None else None)
            failure_class = failure_class or FailureClass.USER_CODE
        self._end_tracking("FINISHED" if new is RunStatus.SUCCESS else "FAILED", reason)
        try:
            self.store.transition(self.run_id, new, reason=reason, failure_class=failure_class,
                                  expected_from=RunStatus.RUNNING)
        except StatusConflictError:  # canceled just now: the children are over anyway
            return self._cancel()
        _log.info("sweep %s: %s%s", self.run_id, new.value, f" ({reason})" if reason else "")
        return new

    # -- MLflow: the parent's own run, which the children's runs nest under ---------------------------
    def _start_tracking(self) -> None:
        def warn(line: str) -> None:
            _log.warning("%s", line)

        try:
            if os.environ.get(AIR_MLFLOW_DOOR):  # started by an air server, whose MLflow may still be starting
                from air.tracking.ui import wait_for_tracking_server

                wait_for_tracking_server()
            self.tracking = AttemptTracking.for_workload(
                experiment=self.plan.experiment, run_name=self.plan.run_name,
                tags={"air.run_id": self.run_id, "air.sweep": "true", "air.sweep_size": str(len(self.items))},
                params=self.plan.parameters or {}, attempt=0, warn=warn)
            if self.tracking.handle is not None:
                self.store.set_mlflow_run_id(self.run_id, self.tracking.handle.run_id)
        except Exception as exc:  # tracking must never fail a sweep
            _log.warning("tracking: off for the sweep: %s", exc)
            self.tracking = None

    def _parent_mlflow_run_id(self) -> str | None:
        """The sweep's MLflow run id once it is made (None before, or without tracking)."""
        tracking = self.tracking
        return tracking.handle.run_id if tracking is not None and tracking.handle is not None else None

    def _end_tracking(self, status: str, reason: str | None) -> None:
        if self._tracking_thread.ident is not None:  # started: it ends within its own bounded waits
            self._tracking_thread.join()
        tracking, self.tracking = self.tracking, None
        if tracking is not None:
            try:
                tracking.end(status, reason)
            except Exception as exc:
                _log.warning("tracking: could not end the sweep's MLflow run: %s", exc)


def _child_spec(parent_spec_yaml: str, parameters: dict[str, object], run_name: str) -> WorkloadSpec:
    """The child's stored spec: the parent's, without `for_each` and its idempotency token, with the
    item's parameters and its own MLflow run name."""
    import yaml

    from air.workload.spec import WorkloadSpec

    data = yaml.safe_load(parent_spec_yaml)
    data.pop("for_each", None)
    data.pop("idempotency_token", None)
    data["parameters"] = parameters
    data["mlflow_run_name"] = run_name
    return WorkloadSpec.model_validate(data)


def run_sweep(run_id: str, store: RunStore) -> RunStatus:
    """The parent's supervisor body (air.runs.supervisor.main calls it for a plan with a sweep)."""
    handler = configure_file(RunPaths(run_id).supervisor_log)
    try:
        return SweepJob(run_id, store).run()
    finally:
        logging.getLogger("air").removeHandler(handler)
        handler.close()
