"""Nothing stays RUNNING forever: any `air` command checks that each supervised run's supervisor lives.

A supervisor that died (kill -9, OOM killer, a reboot) cannot end its own run. The next `air` command
finds it: the recorded PID is gone or belongs to another process (create time differs), so the run's
leftover processes (found by their AIR_PROCESS_TAG) are ended and the run becomes INTERNAL_ERROR with
a reason. A run whose supervisor never started within a grace period is treated the same way.

Every ended attempt also gets its MLflow run, whatever the tracking server's state while it ran (issue 24).
An attempt whose run could not be made (the server was away) is back-filled in a short detached process
(tracking/backfill.py). When the tracking server is one that can be away (http: `air server`'s MLflow), the
run is first marked "tracking pending" (an empty file `AirHome.tracking_pending/<run_id>`, written by the
supervisor that gave up waiting, or by reconcile for a dead one), so a back-fill that cannot happen yet is
not forgotten: `air server` looks at the markers once its MLflow is ready and then every BACKFILL_EVERY_S
(`backfill_pending`), back-fills what is still missing, records the made runs' ids in the store and removes
the marker once nothing is. Finding them costs one listing of an (almost always empty) folder.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

from air.errors import NotFoundError
from air.home import AirHome
from air.store.liveness import process_alive, supervisor_alive
from air.store.paths import is_run_id, process_tag
from air.store.records import Attempt, Run
from air.store.run_store import RunStore
from air.store.states import FailureClass, RunStatus, StatusConflictError

#: A PENDING run with no supervisor recorded after this long never got one.
SUPERVISOR_START_GRACE_S = 60.0
#: How often `air server` back-fills the runs marked "tracking pending" (also once its MLflow is ready).
BACKFILL_EVERY_S = 60.0
#: A marked run whose supervisor still lives (a later attempt runs) is back-filled once its supervisor is
#: gone, or once the marker is this old: the gave-up attempt's creating thread has long stopped by then.
PENDING_SETTLE_S = 900.0


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
    from air.store.paths import RunPaths
    from air.tracking.ended import end_orphaned, refs_of

    paths = RunPaths(run.id)
    end_orphaned(refs_of((a.mlflow_run_id, paths.tracking(a.index)) for a in store.list_attempts(run.id)),
                 "FAILED", log=paths.supervisor_log)


def backfill_tracking(store: RunStore, run_id: str, *, marked: bool = False) -> bool:
    """Ended attempts of `run_id` whose MLflow run was never made (the tracking server was away) get it
    made afterwards, off this command's path (tracking/backfill.py); True when a back-fill started. Through
    a tracking server that can be away, the run is marked "tracking pending" first (`air server` tries again
    until it is made: `backfill_pending`)."""
    from air.store.paths import RunPaths
    from air.tracking.backfill import BackfillJob, backfill_later

    run, paths = store.get_run(run_id), RunPaths(run_id)
    attempts = _missing_attempts(store, run_id)
    if not attempts:
        return False
    from air.tracking.node_hook import spool_of

    marker = _mark(run_id) if marked or _can_be_away() else None
    job: BackfillJob = {"experiment": run.experiment, "run_name": run.run_name, "params_file": str(paths.hyperparameters),
           "tags": {"air.run_id": run.id, "air.accelerator_type": run.accelerator_type,
                    "air.num_accelerators": str(run.num_accelerators), "air.num_nodes": str(run.num_nodes)},
           "attempts": [{"index": a.index, "status": a.status.value, "started_at": a.started_at,
                         "ended_at": a.ended_at, "ref": str(paths.tracking(a.index)),
                         "spool": str(spool_of(paths.mlflow_hook(a.index))),
                         "node_logs": {str(n): str(p) for n, p in paths.node_logs(a.index).items()}}
                        for a in attempts]}
    if marker is not None:
        job["marker"] = str(marker)
    return backfill_later(job, paths.supervisor_log)


def mark_tracking_pending(store: RunStore, run_id: str) -> bool:
    """Mark `run_id` "tracking pending" when one of its ended attempts has no MLflow run and the tracking
    server is one that can be away (the supervisor, after it gave up waiting for it); True when marked.
    Never raises: a run's end is never held up by its bookkeeping of MLflow."""
    try:
        if not _can_be_away() or not _missing_attempts(store, run_id):
            return False
        _mark(run_id)
        return True
    except Exception:
        return False


def backfill_pending(store: RunStore, *, now: float | None = None) -> int:
    """`air server`'s pass over the runs marked "tracking pending" (call it when its MLflow answers): a run
    whose attempts all have their MLflow run now gets their ids recorded and its marker removed; one still
    missing some gets a back-fill started, unless one is at work (it holds the marker locked) or the run's
    supervisor still lives (`PENDING_SETTLE_S`). Returns how many back-fills it started."""
    folder = AirHome().tracking_pending
    try:
        names = sorted(os.listdir(folder))
    except FileNotFoundError:
        return 0
    now = time.time() if now is None else now
    started = 0
    for name in names:
        marker = folder / name
        if not is_run_id(name):
            _unlink(marker)  # nothing of air's: never a path built from it
            continue
        if _settled(store, name, marker, now) and backfill_tracking(store, name, marked=True):
            started += 1
    return started


def _settled(store: RunStore, run_id: str, marker: Path, now: float) -> bool:
    """Whether `run_id`'s back-fill is to start now; False (done here) when nothing is missing any more:
    the made runs' ids recorded, the marker removed, both under the marker's lock."""
    try:
        held = os.open(marker, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a back-fill is at work
        try:
            run = store.get_run(run_id)
        except NotFoundError:
            _unlink(marker)  # deleted (pruned) meanwhile
            return False
        if not _missing_attempts(store, run_id):
            _record_made(store, run_id)
            _unlink(marker)
            return False
        return not (supervisor_alive(run) and now - os.fstat(held).st_mtime < PENDING_SETTLE_S)
    finally:
        os.close(held)  # (and the lock with it; the back-fill process takes it next)


def _record_made(store: RunStore, run_id: str) -> None:
    """Link the attempts whose MLflow run a back-fill made (its tracking note) in the store, as a living
    supervisor would have: `air get run` and the pages show them. The run's own link stays its latest attempt's."""
    import json

    from air.store.paths import RunPaths

    paths, attempts = RunPaths(run_id), store.list_attempts(run_id)
    recorded = False
    for attempt in attempts:
        if attempt.mlflow_run_id:
            continue
        try:
            made = str(json.loads(paths.tracking(attempt.index).read_text())["run_id"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        store.set_mlflow_run_id(run_id, made, attempt=attempt.index)
        recorded = True
    latest = attempts[-1] if attempts else None
    if recorded and latest is not None and latest.mlflow_run_id:  # (set_mlflow_run_id links the run too)
        store.set_mlflow_run_id(run_id, latest.mlflow_run_id, attempt=latest.index)


def _missing_attempts(store: RunStore, run_id: str) -> list[Attempt]:
    """The ended attempts of `run_id` that ran with tracking on and have no MLflow run (backfill.missing)."""
    from air.store.paths import RunPaths
    from air.tracking.backfill import missing

    paths = RunPaths(run_id)
    return [a for a in store.list_attempts(run_id) if a.ended_at is not None
            and missing(paths.mlflow_env(a.index), paths.tracking(a.index), a.mlflow_run_id,
                        paths.mlflow_hook(a.index))]


def _can_be_away() -> bool:
    """Whether this process's tracking server is one that can be away (http), so a back-fill may have to wait."""
    from air.tracking.store import is_http, tracking_uri

    return is_http(tracking_uri())


def _mark(run_id: str) -> Path:
    """`run_id`'s marker: an empty file, its time when it was first marked (marking again keeps it)."""
    folder = AirHome().tracking_pending
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    marker = folder / run_id
    os.close(os.open(marker, os.O_WRONLY | os.O_CREAT, 0o600))
    return marker


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


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
    """The run's processes (and a Slurm run's jobs) on its profile's backend."""
    try:
        from air.backends import backend_for
        from air.config import resolve_profile

        return int(backend_for(resolve_profile(run.profile)).reap(process_tag(run.id)))
    except Exception:
        return 0
