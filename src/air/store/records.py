"""The run store's records: `Run` and `Attempt` (one row of `runs` / `attempts` each) and their row mapping.

Kept apart from the store so readers of a record (the CLI's tables and `--json`) need not know SQL.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from air.store.states import AttemptStatus, FailureClass, PriorityClass, RunStatus

#: What a run is: a workload YAML (`air run`), or a `@distributed` call (local, or remote=True).
RUN_KINDS = ("workload", "call")
#: Kinds older air versions wrote, read as today's: remote calls were recorded as "distributed".
_LEGACY_KINDS = {"distributed": "call"}

_RUN_COLUMNS = (
    "id", "experiment", "run_name", "status", "accelerator_type", "num_accelerators", "num_nodes",
    "backend", "profile", "spec", "submitted_at", "started_at", "ended_at", "termination_reason",
    "failure_class", "idempotency_key", "supervisor_pid", "supervisor_started_at", "mlflow_run_id",
    "user", "kind", "current_attempt", "pool", "permissions", "priority", "preempted_by", "preemptions",
)
RUN_SELECT = "SELECT " + ", ".join(_RUN_COLUMNS) + " FROM runs"
ATTEMPT_SELECT = (
    "SELECT run_id, attempt, status, started_at, ended_at, termination_reason, failure_class, exit_code, "
    "signal, mlflow_run_id FROM attempts"
)


@dataclass(frozen=True)
class Run:
    """One row of `runs`: what the user submitted and where it stands. Immutable; re-read to refresh."""

    id: str
    experiment: str
    status: RunStatus
    accelerator_type: str
    num_accelerators: int
    num_nodes: int
    submitted_at: float
    backend: str = "local"
    kind: str = "workload"
    run_name: str | None = None
    profile: str | None = None
    spec_yaml: str = field(default="", repr=False)
    user: str = ""
    started_at: float | None = None
    ended_at: float | None = None
    termination_reason: str | None = None
    failure_class: FailureClass | None = None
    idempotency_key: str | None = None
    supervisor_pid: int | None = None
    supervisor_started_at: float | None = None
    mlflow_run_id: str | None = None
    #: 0-based index of the latest attempt; None before the first one starts.
    current_attempt: int | None = None
    #: The pool it waits in and runs on (config.yaml `pools:`); None: no pools configured, the whole machine.
    pool: str | None = None
    #: Who else may see or act on it (the workload's `permissions`), as access.grants_to_json wrote it:
    #: JSON `[{"user"|"group": NAME, "level": CAN_…}]`; None: none given (the server's default applies).
    permissions: str | None = None
    #: Where it stands in its pool's queue (`compute.priority_class`; stored as its rank).
    priority_class: PriorityClass = PriorityClass.NORMAL
    #: The CRITICAL run that asked it to give its slots back (runs/preemption.py); None: not asked.
    preempted_by: str | None = None
    #: Attempts of it that were preempted: they are not retries (see `retries`).
    preemptions: int = 0

    @property
    def is_terminal(self) -> bool:
        return self.status.is_terminal()

    @property
    def attempt_count(self) -> int:
        """Attempts started so far (retries = attempt_count - 1)."""
        return 0 if self.current_attempt is None else self.current_attempt + 1

    @property
    def retries(self) -> int:
        """Attempts after the first that a failure caused: preempted attempts are not counted."""
        return max(self.attempt_count - 1 - self.preemptions, 0)

    @property
    def slot_kind(self) -> str:
        """'GPU' or 'CPU': which slot ledger the run draws from (the accelerator type's prefix)."""
        return self.accelerator_type.split("_", 1)[0].upper()

    def duration_seconds(self, now: float | None = None) -> float | None:
        """From first start to end (or to `now` while it runs); None if it never started."""
        if self.started_at is None:
            return None
        end = self.ended_at if self.ended_at is not None else (time.time() if now is None else now)
        return max(0.0, end - self.started_at)


@dataclass(frozen=True)
class Attempt:
    """One row of `attempts`: one try of a run, with its own logs (`attempt_<index>/`) and MLflow run."""

    run_id: str
    index: int
    status: AttemptStatus
    started_at: float
    ended_at: float | None = None
    termination_reason: str | None = None
    failure_class: FailureClass | None = None
    exit_code: int | None = None
    signal: int | None = None
    mlflow_run_id: str | None = None

    @property
    def signal_name(self) -> str | None:
        """'SIGKILL' for signal 9, and so on."""
        if self.signal is None:
            return None
        import signal as _signal

        try:
            return _signal.Signals(self.signal).name
        except ValueError:
            return f"signal {self.signal}"

    def duration_seconds(self, now: float | None = None) -> float:
        end = self.ended_at if self.ended_at is not None else (time.time() if now is None else now)
        return max(0.0, end - self.started_at)


class CreateRunResult(NamedTuple):
    """What `create_run` returns: the run, and whether it already existed (idempotency key replay)."""

    run: Run
    existing: bool


def run_from_row(row: Sequence[Any]) -> Run:
    (id_, experiment, run_name, status, accelerator_type, num_accelerators, num_nodes, backend, profile,
     spec, submitted_at, started_at, ended_at, termination_reason, failure_class, idempotency_key,
     supervisor_pid, supervisor_started_at, mlflow_run_id, user, kind, current_attempt, pool, permissions,
     priority, preempted_by, preemptions) = row
    return Run(
        id=id_, experiment=experiment, run_name=run_name, status=RunStatus(status),
        accelerator_type=accelerator_type, num_accelerators=num_accelerators, num_nodes=num_nodes,
        backend=backend, profile=profile, spec_yaml=spec, submitted_at=submitted_at,
        started_at=started_at, ended_at=ended_at, termination_reason=termination_reason,
        failure_class=FailureClass(failure_class) if failure_class else None,
        idempotency_key=idempotency_key, supervisor_pid=supervisor_pid,
        supervisor_started_at=supervisor_started_at, mlflow_run_id=mlflow_run_id, user=user,
        kind=_LEGACY_KINDS.get(kind, kind), current_attempt=current_attempt, pool=pool,
        permissions=permissions, priority_class=PriorityClass.from_rank(priority), preempted_by=preempted_by,
        preemptions=preemptions or 0,
    )


def attempt_from_row(row: Sequence[Any]) -> Attempt:
    run_id, index, status, started_at, ended_at, reason, failure_class, exit_code, sig, mlflow_run_id = row
    return Attempt(
        run_id=run_id, index=index, status=AttemptStatus(status), started_at=started_at, ended_at=ended_at,
        termination_reason=reason, failure_class=FailureClass(failure_class) if failure_class else None,
        exit_code=exit_code, signal=sig, mlflow_run_id=mlflow_run_id,
    )


def run_values(run: Run, queue_seq: int | None) -> tuple[object, ...]:
    return (
        run.id, run.experiment, run.run_name, run.status.value, run.accelerator_type, run.num_accelerators,
        run.num_nodes, run.backend, run.profile, run.spec_yaml, run.submitted_at, run.started_at,
        run.ended_at, run.termination_reason, run.failure_class.value if run.failure_class else None,
        run.idempotency_key, run.supervisor_pid, run.supervisor_started_at, run.mlflow_run_id, run.user,
        run.kind, run.current_attempt, run.pool, run.permissions, run.priority_class.rank, run.preempted_by,
        run.preemptions, queue_seq,
    )


INSERT_RUN = (
    "INSERT INTO runs (" + ", ".join(_RUN_COLUMNS) + ", queue_seq) VALUES ("
    + ", ".join("?" for _ in range(len(_RUN_COLUMNS) + 1)) + ")"
)

def current_user() -> str:
    import getpass

    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (containers)
        return str(os.getuid())
