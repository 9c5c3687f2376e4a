"""`air cancel ID… | --all`: end runs and every process they started (the protocol: air.runs.cancel)."""

from __future__ import annotations

import sys

import click

from air.cli.complete import complete_active_run_id
from air.cli.main import common, settings
from air.cli.output import envelope, status, stderr
from air.errors import UserInputError

#: `--all`: how many active runs one cancel looks at (more than any machine or server holds).
ALL_RUNS = 100_000


@click.command()
@click.argument("run_ids", nargs=-1, metavar="[RUN_ID]...", shell_complete=complete_active_run_id)
@click.option("--all", "all_runs", is_flag=True, help="Cancel every active run.")
@click.option("-y", "--yes", is_flag=True, help="Do not ask for confirmation.")
@common
def cancel(run_ids: tuple[str, ...], all_runs: bool, yes: bool) -> int:
    """Cancel runs: TERMINATING, then CANCELED once every process is gone."""
    from air.client.sdk import Client

    if all_runs == bool(run_ids):
        raise UserInputError(
            "Give run ids or --all (not both, not neither).", hint="air cancel RUN_ID… | --all -y"
        )
    client = Client(profile=settings().profile)  # through a server, --all is your own active runs
    targets = ([str(r["run_id"]) for r in client.list_data(limit=ALL_RUNS, queue_for=0)] if all_runs
               else [client.get(i).run_id for i in run_ids])  # every id is checked before any is canceled
    if not targets:
        status("No active runs.")
        return 0
    if all_runs and not yes:
        if not sys.stdin.isatty():  # click 8.5 deprecates get_text_stream
            raise UserInputError(f"Refusing to cancel {len(targets)} run(s) without confirmation.", hint="Add -y.")
        click.confirm(f"Cancel {len(targets)} active run(s)?", abort=True)
    results = {run_id: client.cancel(run_id).status.value for run_id in targets}
    if settings().json:
        envelope({"runs": [{"run_id": k, "status": v} for k, v in results.items()]})
    else:
        for run_id, outcome in results.items():
            stderr(f"{run_id}: {outcome}")
    return 0
