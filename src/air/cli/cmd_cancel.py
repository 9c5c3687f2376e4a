"""`air cancel ID… | --all`: end runs and every process they started."""

from __future__ import annotations

import sys
import time

import click

from air.cli.complete import complete_active_run_id
from air.cli.main import common, settings
from air.cli.output import envelope, status, stderr
from air.errors import UserInputError
from air.runs.states import FailureClass, RunStatus, StatusConflictError
from air.runs.store import RunStore

CANCEL_WAIT_S = 30.0


def cancel_run(store: RunStore, run_id: str) -> RunStatus:
    """Ask the supervisor to end the run (TERMINATING), wait for it; end it here if it has no supervisor."""
    from air.launcher import reap_tag
    from air.runs.liveness import supervisor_alive
    from air.runs.paths import process_tag

    run = store.get_run(run_id)
    if run.is_terminal:
        return run.status
    try:
        store.transition(run.id, RunStatus.TERMINATING, reason="Canceled by the user",
                         failure_class=FailureClass.CANCEL, expected_from=run.status)
    except StatusConflictError:
        return cancel_run(store, run_id)
    deadline = time.monotonic() + CANCEL_WAIT_S
    while time.monotonic() < deadline:
        run = store.get_run(run.id)
        if run.is_terminal:
            return run.status
        alive = supervisor_alive(run)
        if alive is False or (alive is None and time.monotonic() > deadline - CANCEL_WAIT_S + 5):
            break  # dead, or never started: nobody else will end it
        time.sleep(0.1)
    # No supervisor (or it did not answer in time): end the processes here.
    reap_tag(process_tag(run.id))
    try:
        return store.transition(run.id, RunStatus.CANCELED, reason="Canceled by the user",
                                failure_class=FailureClass.CANCEL, expected_from=RunStatus.TERMINATING).status
    except StatusConflictError:
        return store.get_run(run.id).status


@click.command()
@click.argument("run_ids", nargs=-1, metavar="[RUN_ID]...", shell_complete=complete_active_run_id)
@click.option("--all", "all_runs", is_flag=True, help="Cancel every active run.")
@click.option("-y", "--yes", is_flag=True, help="Do not ask for confirmation.")
@common
def cancel(run_ids: tuple[str, ...], all_runs: bool, yes: bool) -> int:
    """Cancel runs: TERMINATING, then CANCELED once every process is gone."""
    store = RunStore()
    if all_runs == bool(run_ids):
        raise UserInputError("Give run ids or --all (not both, not neither).", hint="air cancel RUN_ID… | --all -y")
    targets = [r.id for r in store.list_runs(limit=None)] if all_runs else [store.get_run(i).id for i in run_ids]
    if not targets:
        status("No active runs.")
        return 0
    if all_runs and not yes:
        if not sys.stdin.isatty():  # click 8.5 deprecates get_text_stream
            raise UserInputError(f"Refusing to cancel {len(targets)} run(s) without confirmation.", hint="Add -y.")
        click.confirm(f"Cancel {len(targets)} active run(s)?", abort=True)
    results = {run_id: cancel_run(store, run_id).value for run_id in targets}
    if settings().json:
        envelope({"runs": [{"run_id": k, "status": v} for k, v in results.items()]})
    else:
        for run_id, outcome in results.items():
            stderr(f"{run_id}: {outcome}")
    return 0
