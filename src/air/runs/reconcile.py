"""Nothing stays RUNNING forever: any `air` command checks that each supervised run's supervisor lives.

A supervisor that died (kill -9, OOM killer, a reboot) cannot end its own run. The next `air` command
finds it: the recorded PID is gone or belongs to another process (create time differs), so the run's
leftover processes (found by their AIR_PROCESS_TAG) are ended and the run becomes INTERNAL_ERROR with
a reason. A run whose supervisor never started within a grace period is treated the same way.
"""

from __future__ import annotations

import time

from air.runs.liveness import process_alive
from air.runs.paths import process_tag
from air.runs.records import Run
from air.runs.states import FailureClass, RunStatus, StatusConflictError
from air.runs.store import RunStore

#: A PENDING run with no supervisor recorded after this long never got one.
SUPERVISOR_START_GRACE_S = 60.0


def reconcile(store: RunStore, *, now: float | None = None) -> list[str]:
    """End runs whose supervisor is gone; returns their ids. Cheap when nothing is wrong: only runs that
    have (or should have) a supervisor are read, a few columns each (`_supervised`); a QUEUED run waiting
    for the admission loop has none and is not dead (5,000 of them cost one index probe)."""
    from air.launcher import reap_tag

    now = time.time() if now is None else now
    ended: list[str] = []
    for run_id, status, pid, started_at, submitted_at in _supervised(store):
        if pid is not None and started_at is not None and process_alive(pid, started_at):
            continue
        if pid is None:
            if now - submitted_at < SUPERVISOR_START_GRACE_S:
                continue
            reason = "The supervisor never started"
        run = store.get_run(run_id)
        if pid is not None:
            who = "caller of the @distributed call" if run.kind == "call" else "supervisor"
            reason = f"The {who} (pid {pid}) died unexpectedly"
        killed = reap_tag(process_tag(run.id), subtags=True) if run.backend == "local" else _reap_remote(run)
        if killed:
            reason += f"; {killed} leftover process(es) of the run were ended"
        try:
            store.transition(run.id, RunStatus.INTERNAL_ERROR, reason=reason,
                             failure_class=FailureClass.INFRASTRUCTURE, expected_from=RunStatus(status))
            ended.append(run.id)
        except StatusConflictError:
            continue  # it moved meanwhile: someone else is handling it
        _end_mlflow_runs(store, run)
        backfill_tracking(store, run.id)
    return ended


def _end_mlflow_runs(store: RunStore, run: Run) -> None:
    """The dead supervisor's attempts' MLflow runs end FAILED too (off this command's path: tracking/ended.py)."""
    from air.runs.paths import RunPaths
    from air.tracking.ended import end_orphaned, refs_of

    paths = RunPaths(run.id)
    end_orphaned(refs_of((a.mlflow_run_id, paths.tracking(a.index)) for a in store.list_attempts(run.id)),
                 "FAILED", log=paths.supervisor_log)


def backfill_tracking(store: RunStore, run_id: str) -> bool:
    """Ended attempts of `run_id` whose MLflow run was never made (the tracking server was away) get it
    made afterwards, off this command's path (tracking/backfill.py); True when a back-fill started."""
    from air.runs.paths import RunPaths
    from air.tracking.backfill import BackfillJob, backfill_later, missing
    from air.tracking.node_hook import spool_of

    run, paths = store.get_run(run_id), RunPaths(run_id)
    attempts = [a for a in store.list_attempts(run_id) if a.ended_at is not None
                and missing(paths.mlflow_env(a.index), paths.tracking(a.index), a.mlflow_run_id,
                            paths.mlflow_hook(a.index))]
    if not attempts:
        return False
    job: BackfillJob = {"experiment": run.experiment, "run_name": run.run_name, "params_file": str(paths.hyperparameters),
           "tags": {"air.run_id": run.id, "air.accelerator_type": run.accelerator_type,
                    "air.num_accelerators": str(run.num_accelerators), "air.num_nodes": str(run.num_nodes)},
           "attempts": [{"index": a.index, "status": a.status.value, "started_at": a.started_at,
                         "ended_at": a.ended_at, "ref": str(paths.tracking(a.index)),
                         "spool": str(spool_of(paths.mlflow_hook(a.index))),
                         "node_logs": {str(n): str(p) for n, p in paths.node_logs(a.index).items()}}
                        for a in attempts]}
    return backfill_later(job, paths.supervisor_log)


def _supervised(store: RunStore) -> list[tuple[str, str, int | None, float | None, float]]:
    """(id, status, supervisor pid, its create time, submitted_at) of the active runs that have a supervisor
    or should have one by now: every active state but QUEUED, and QUEUED runs with a supervisor (a retry, a
    call waiting in its caller, an admitted run acquiring). Both halves are index range reads."""
    others = sorted(s.value for s in RunStatus.active() - {RunStatus.QUEUED})
    sql = (f"SELECT id, status, supervisor_pid, supervisor_started_at, submitted_at FROM runs WHERE status IN "
           f"({', '.join('?' for _ in others)}) UNION ALL "
           "SELECT id, status, supervisor_pid, supervisor_started_at, submitted_at FROM runs "
           "WHERE status = ? AND supervisor_pid IS NOT NULL")
    rows = store.reader().execute(sql, (*others, RunStatus.QUEUED.value))
    return [(r[0], r[1], r[2], r[3], float(r[4])) for r in rows]


def _reap_remote(run: Run) -> int:
    try:
        from air.backends.ray_backend import RayBackend
        from air.config import resolve_profile
        profile = resolve_profile(run.profile)
        return int(RayBackend(getattr(profile, "address", None)).reap(process_tag(run.id)))
    except Exception:
        return 0
