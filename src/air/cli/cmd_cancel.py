"""`air cancel ID… | --all`: end runs and every process they started (the protocol: air.runs.cancel)."""

from __future__ import annotations

import sys

import click

from air.cli.complete import complete_active_run_id
from air.cli.main import common, settings
from air.cli.output import envelope, status, stderr
from air.errors import UserInputError
from air.runs.cancel import active_run_ids, cancel_runs, canceled_by, local_user
from air.runs.store import RunStore


@click.command()
@click.argument("run_ids", nargs=-1, metavar="[RUN_ID]...", shell_complete=complete_active_run_id)
@click.option("--all", "all_runs", is_flag=True, help="Cancel every active run.")
@click.option("-y", "--yes", is_flag=True, help="Do not ask for confirmation.")
@common
def cancel(run_ids: tuple[str, ...], all_runs: bool, yes: bool) -> int:
    """Cancel runs: TERMINATING, then CANCELED once every process is gone."""
    from air.cli.remote import remote

    if all_runs == bool(run_ids):
        raise UserInputError(
            "Give run ids or --all (not both, not neither).", hint="air cancel RUN_ID… | --all -y"
        )
    client = remote()
    if client is not None:  # --all: your own active runs
        from air.client.models import CancelAnswer, Run, RunList

        targets = ([r.run_id for r in RunList.model_validate(client.get("/runs", limit=100_000)).runs] if all_runs
                   else [Run.model_validate(client.get(f"/runs/{i}")).run_id for i in run_ids])
    else:
        store = RunStore()
        targets = active_run_ids(store) if all_runs else [store.get_run(i).id for i in run_ids]
    if not targets:
        status("No active runs.")
        return 0
    if all_runs and not yes:
        if not sys.stdin.isatty():  # click 8.5 deprecates get_text_stream
            raise UserInputError(f"Refusing to cancel {len(targets)} run(s) without confirmation.", hint="Add -y.")
        click.confirm(f"Cancel {len(targets)} active run(s)?", abort=True)
    if client is not None:
        results = {run_id: CancelAnswer.model_validate(client.post(f"/runs/{run_id}/cancel")).status.value
                   for run_id in targets}
    else:
        results = {run_id: outcome.value for run_id, outcome in cancel_runs(store, targets, reason=canceled_by(local_user())).items()}
    if settings().json:
        envelope({"runs": [{"run_id": k, "status": v} for k, v in results.items()]})
    else:
        for run_id, outcome in results.items():
            stderr(f"{run_id}: {outcome}")
    return 0
