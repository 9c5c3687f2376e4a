"""`air prune` (alias `air gc`): remove ended runs, calls, snapshots and environments older than N days."""

from __future__ import annotations

import click

from air.cli.main import common, settings
from air.cli.output import envelope, stderr
from air.runs.prune import DEFAULT_OLDER_THAN_DAYS


@click.command()
@click.option(
    "--older-than-days",
    type=click.FloatRange(min=0),
    default=DEFAULT_OLDER_THAN_DAYS,
    show_default=True,
    metavar="DAYS",
    help="Only what ended (or was last used) more than this many days ago.",
)
@click.option("--dry-run", is_flag=True, help="List what would be removed; remove nothing.")
@common
def prune(older_than_days: float, dry_run: bool) -> None:
    """Remove ended runs (rows and folders), call folders, code snapshots and unused environments.

    Never an active run, nor a snapshot or environment an active run uses. MLflow records stay.
    """
    from dataclasses import asdict

    from air.runs.prune import prune as prune_home

    report = prune_home(older_than_days, dry_run=dry_run)
    if settings().json:
        envelope({**asdict(report), "count": report.count})
        return
    verb = "Would remove" if dry_run else "Removed"
    for label, items in (
        ("run", report.runs),
        ("call", report.calls),
        ("snapshot", report.snapshots),
        ("environment", report.environments),
    ):
        for item in items:
            print(f"{label:<12} {item}")
    for note in report.notes:
        stderr(f"note: {note}")
    stderr(
        f"{verb} {len(report.runs)} run(s), {len(report.calls)} call(s), {len(report.snapshots)} snapshot(s), "
        f"{len(report.environments)} environment(s): {report.bytes / 1e6:.1f} MB "
        f"(older than {older_than_days:g} days)."
    )
