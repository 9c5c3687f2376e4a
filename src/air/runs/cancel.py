"""Canceling runs: ask the run's supervisor to end it, wait, and end it here when nobody else will.

The protocol (the CLI only parses arguments and prints): the run goes to TERMINATING (a compare-and-set,
so a run that changed state meanwhile is looked at again); its supervisor sees that, tears its nodes down
and sets CANCELED. When the supervisor is dead, never started, or does not answer within
`CANCEL_WAIT_S`, every process carrying the run's tag is ended here and the run set CANCELED.
"""

from __future__ import annotations

import time

from air.constants import CANCEL_NO_SUPERVISOR_S, CANCEL_WAIT_S
from air.runs.paths import process_tag
from air.runs.states import FailureClass, RunStatus, StatusConflictError
from air.runs.store import RunStore, supervisor_alive

#: The reason every canceled run carries.
CANCEL_REASON = "Canceled by the user"


def may_cancel(run_user: str | None, user: str, *, admin: bool) -> bool:
    """Who may cancel a run on a shared server (its API and its pages alike): its owner or an admin."""
    return admin or (run_user is not None and run_user == user)


def cancel_run(store: RunStore, run_id: str) -> RunStatus:
    """End one run and every process it started; returns its final (or current terminal) status."""
    from air.launcher import reap_tag

    run = store.get_run(run_id)
    if run.is_terminal:
        return run.status
    try:
        store.transition(
            run.id,
            RunStatus.TERMINATING,
            reason=CANCEL_REASON,
            failure_class=FailureClass.CANCEL,
            expected_from=run.status,
        )
    except StatusConflictError:
        return cancel_run(store, run_id)
    started = time.monotonic()
    deadline = started + CANCEL_WAIT_S
    while time.monotonic() < deadline:
        run = store.get_run(run.id)
        if run.is_terminal:
            return run.status
        alive = supervisor_alive(run)
        if alive is False or (alive is None and time.monotonic() > started + CANCEL_NO_SUPERVISOR_S):
            break  # dead, or never started: nobody else will end it
        time.sleep(0.1)
    # No supervisor (or it did not answer in time): end the processes here.
    reap_tag(process_tag(run.id))
    try:
        return store.transition(
            run.id,
            RunStatus.CANCELED,
            reason=CANCEL_REASON,
            failure_class=FailureClass.CANCEL,
            expected_from=RunStatus.TERMINATING,
        ).status
    except StatusConflictError:
        return store.get_run(run.id).status


def active_run_ids(store: RunStore) -> list[str]:
    """Every run that is not over yet (what `air cancel --all` ends)."""
    return [r.id for r in store.list_runs(limit=None)]


def cancel_runs(store: RunStore, run_ids: list[str]) -> dict[str, RunStatus]:
    """Cancel each run in turn: run id -> its status afterwards."""
    return {run_id: cancel_run(store, run_id) for run_id in run_ids}


__all__ = ["CANCEL_REASON", "active_run_ids", "cancel_run", "cancel_runs"]
