"""Canceling runs: ask the run's supervisor to end it, wait, and end it here when nobody else will.

The protocol (the CLI only parses arguments and prints): the run goes to TERMINATING (a compare-and-set,
so a run that changed state meanwhile is looked at again); its supervisor sees that, tears its nodes down
and sets CANCELED. When the supervisor is dead, never started, or does not answer within
`CANCEL_WAIT_S`, every process carrying the run's tag is ended here and the run set CANCELED.

The run's termination reason names who canceled it ("Canceled by alice"; "Canceled by root (admin)" when
an admin ends another user's run; locally the OS user); the supervisor keeps that reason when it ends the run.
"""

from __future__ import annotations

import time

from air.constants import CANCEL_NO_SUPERVISOR_S, CANCEL_WAIT_S
from air.store.liveness import supervisor_alive
from air.store.paths import process_tag
from air.store.run_store import RunStore
from air.store.states import FailureClass, RunStatus, StatusConflictError

#: The reason a canceled run carries when nobody is named.
CANCEL_REASON = "Canceled by the user"


def canceled_by(user: str | None, *, admin: bool = False, owner: str | None = None) -> str:
    """The reason a run canceled by `user` carries: "(admin)" is added when an admin ends someone else's run."""
    if not user:
        return CANCEL_REASON
    return f"Canceled by {user}{' (admin)' if admin and owner != user else ''}"


def local_user() -> str:
    """The OS user of this process (who cancels from a local AIR_HOME)."""
    import getpass
    import os

    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


def cancel_run(store: RunStore, run_id: str, *, reason: str = CANCEL_REASON) -> RunStatus:
    """End one run and every process it started; returns its final (or current terminal) status.
    `reason`: its termination reason (`canceled_by(...)` names who asked). A `for_each` sweep's children
    go with it: its supervisor cancels them, and so does this, for a sweep whose supervisor is gone."""
    status = _cancel_one(store, run_id, reason=reason)
    cancel_sweep_children(store, store.get_run(run_id).id, reason)
    return status


def cancel_sweep_children(store: RunStore, run_id: str, reason: str) -> dict[str, RunStatus]:
    """Cancel every child of the sweep `run_id` not ended yet, side by side (every child's supervisor tears
    down at the same time, not one after another); child id → its status. Empty for any other run."""
    from concurrent.futures import ThreadPoolExecutor

    from air.runs.sweep_tasks import child_run, child_run_ids

    active = [c for c in child_run_ids(store, run_id) if (child := child_run(store, c)) and not child.is_terminal]
    if not active:
        return {}
    with ThreadPoolExecutor(max_workers=min(len(active), 16), thread_name_prefix="air-sweep-cancel") as pool:
        return dict(zip(active, pool.map(lambda c: _cancel_one(store, c, reason=reason), active), strict=True))


def _cancel_one(store: RunStore, run_id: str, *, reason: str) -> RunStatus:
    from air.launcher import reap_tag

    run = store.get_run(run_id)
    if run.is_terminal:
        return run.status
    if run.status is RunStatus.QUEUED and run.supervisor_pid is None:  # a row waiting for admission: no process
        try:  # (a supervisor the admission loop starts meanwhile finds its run CANCELED, its slots released)
            return store.transition(run.id, RunStatus.CANCELED, reason=reason, failure_class=FailureClass.CANCEL,
                                    expected_from=RunStatus.QUEUED).status
        except StatusConflictError:
            return _cancel_one(store, run_id, reason=reason)
    try:
        if run.status is not RunStatus.TERMINATING:  # (already: another cancel is under way; wait with it)
            store.transition(
                run.id,
                RunStatus.TERMINATING,
                reason=reason,
                failure_class=FailureClass.CANCEL,
                expected_from=run.status,
            )
    except StatusConflictError:
        return _cancel_one(store, run_id, reason=reason)
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
            reason=store.get_run(run.id).termination_reason or reason,
            failure_class=FailureClass.CANCEL,
            expected_from=RunStatus.TERMINATING,
        ).status
    except StatusConflictError:
        return store.get_run(run.id).status

