"""Nothing stays RUNNING forever: any `air` command checks that each active run's supervisor lives.

A supervisor that died (kill -9, OOM killer, a reboot) cannot end its own run. The next `air` command
finds it: the recorded PID is gone or belongs to another process (create time differs), so the run's
leftover processes (found by their AIR_PROCESS_TAG) are ended and the run becomes INTERNAL_ERROR with
a reason. A run whose supervisor never started within a grace period is treated the same way.
"""

from __future__ import annotations

import time

from air.runs.liveness import supervisor_alive
from air.runs.paths import process_tag
from air.runs.records import Run
from air.runs.states import FailureClass, RunStatus, StatusConflictError
from air.runs.store import RunStore

#: A PENDING run with no supervisor recorded after this long never got one.
SUPERVISOR_START_GRACE_S = 60.0


def reconcile(store: RunStore, *, now: float | None = None) -> list[str]:
    """End runs whose supervisor is gone; returns their ids. Cheap when nothing is wrong."""
    from air.launcher import reap_tag

    now = time.time() if now is None else now
    ended: list[str] = []
    for run in store.list_runs(statuses=RunStatus.active(), limit=None):
        if supervisor_alive(run) is True:
            continue
        if run.supervisor_pid is None:
            if now - run.submitted_at < SUPERVISOR_START_GRACE_S:
                continue
            reason = "The supervisor never started"
        else:
            who = "caller of the @distributed call" if run.kind == "call" else "supervisor"
            reason = f"The {who} (pid {run.supervisor_pid}) died unexpectedly"
        killed = reap_tag(process_tag(run.id), subtags=True) if run.backend == "local" else _reap_remote(run)
        if killed:
            reason += f"; {killed} leftover process(es) of the run were ended"
        try:
            store.transition(run.id, RunStatus.INTERNAL_ERROR, reason=reason,
                             failure_class=FailureClass.INFRASTRUCTURE, expected_from=run.status)
            ended.append(run.id)
        except StatusConflictError:
            continue  # it moved meanwhile: someone else is handling it
    return ended


def _reap_remote(run: Run) -> int:
    try:
        from air.backends.ray_backend import RayBackend
        from air.config import resolve_profile
        profile = resolve_profile(run.profile)
        return int(RayBackend(getattr(profile, "address", None)).reap(process_tag(run.id)))
    except Exception:
        return 0
