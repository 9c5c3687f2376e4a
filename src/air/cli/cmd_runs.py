"""`air get run ID` and `air list runs`."""

from __future__ import annotations

from typing import Any

import click

from air.cli.complete import complete_run_id
from air.cli.main import common, settings
from air.cli.output import envelope, fmt_duration, fmt_time, print_fields, print_table
from air.errors import UserInputError
from air.runs.states import RunStatus
from air.runs.states import statuses as parse_statuses
from air.runs.store import Run, RunStore
from air.runs.views import (
    call_rank_logs,
    checkpoint_view,
    mlflow_link,
    progress_view,
    queue_dict,
    quiet_summary,
    run_detail,
    run_dict,
    run_folder,
)


@click.group()
def get() -> None:
    """Show one object in detail."""


@get.command("run")
@click.argument("run_id", shell_complete=complete_run_id)
@common
def get_run(run_id: str) -> None:
    """A run: status, attempts, termination reason, MLflow run, logs."""

    store = RunStore()
    run = store.get_run(run_id)
    if settings().json:
        envelope(run_detail(store, run))
        return
    attempts = store.list_attempts(run.id)
    link = mlflow_link(run)
    pairs = [
        ("Run", run.id), ("Status", run.status.value), *_waiting(store, run), ("Experiment", run.experiment),
        ("MLflow run name", run.run_name or run.experiment),
        ("Accelerators", f"{run.num_accelerators} × {run.accelerator_type} ({run.num_nodes} node(s))"),
        ("Backend", f"{run.backend} (profile {run.profile or 'local'})"), ("User", run.user or "-"),
        ("Submitted", fmt_time(run.submitted_at)), ("Started", fmt_time(run.started_at)),
        ("Ended", fmt_time(run.ended_at)), ("Duration", fmt_duration(run.duration_seconds())),
        ("Attempts", f"{run.attempt_count} (retries: {max(run.attempt_count - 1, 0)})"),
    ]
    if run.termination_reason and not run.status.value == "SUCCESS":
        pairs.append(("Termination reason", run.termination_reason))
    quiet = quiet_summary(progress_view(run)) if not run.status.is_terminal() else None
    if quiet:
        pairs.append(("Progress", quiet))
    checkpoints = checkpoint_view(run)
    if checkpoints["checkpoint_dir"]:
        pairs.append(("Checkpoints", checkpoints["checkpoint_dir"]))
        pairs.append(("Last checkpoint", checkpoints["latest_checkpoint"] or "-"))
    if run.failure_class:
        pairs.append(("Failure class", run.failure_class.value))
    pairs.append(("MLflow run", run.mlflow_run_id or "-"))
    if link:
        pairs.append(("MLflow UI", f"{link}   (start the UI with: air ui)"))
    if run.kind == "call":
        pairs.insert(1, ("Kind", f"call of {run.run_name or 'a function'} (@distributed)"))
    pairs.append(("Folder", str(run_folder(run))))
    print_fields(pairs)
    if run.kind == "call":
        print()
        print_table(["RANK", "LOG"], [[str(r["rank"]), r["path"] + ("" if r["exists"] else "  (not written)")]
                                      for r in call_rank_logs(run)])
        if run.backend == "local":
            print(f"\nLogs: air logs {run.id} [--rank N]")
            return
    if attempts:
        print()
        print_table(["ATTEMPT", "STATUS", "STARTED", "DURATION", "REASON", "MLFLOW RUN"], [
            [str(a.index), a.status.value, fmt_time(a.started_at), fmt_duration(a.duration_seconds()),
             a.termination_reason or "", a.mlflow_run_id or ""] for a in attempts])
        print(f"\nLogs: air logs {run.id} [--node N] [--retry A]")


def _waiting(store: RunStore, run: Run) -> list[tuple[str, str]]:
    """("Waiting", reason) for a QUEUED run, nothing otherwise."""
    queue = queue_dict(store, run)
    return [("Waiting", queue["reason"])] if queue else []


@click.group("list")
def list_() -> None:
    """List objects."""


def _filters(values: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in values:
        key, sep, value = item.partition("=")
        key = key.strip().lower()
        if not sep or not value:
            raise UserInputError(f"--filter {item!r} must look like KEY=VALUE.",
                                 hint="Keys: experiment=GLOB, accelerator_type=TEXT, num_accelerators=N.")
        if key == "experiment":
            out["experiment_glob"] = value
        elif key == "accelerator_type":
            out["accelerator_type"] = value
        elif key == "num_accelerators":
            if not value.isdigit() or int(value) <= 0:
                raise UserInputError(f"--filter num_accelerators must be a positive integer, got {value!r}.")
            out["num_accelerators"] = int(value)
        else:
            raise UserInputError(f"Unknown filter {key!r}.",
                                 hint="Keys: experiment=GLOB, accelerator_type=TEXT, num_accelerators=N.")
    return out


@list_.command("runs")
@click.option("--all-status", "all_status", is_flag=True, help="Include ended runs (default: active ones only).")
@click.option("--status", "status_names", multiple=True, metavar="STATUS", help="Only runs in these states.")
@click.option("--limit", default=20, show_default=True, type=click.IntRange(min=1), help="At most this many runs.")
@click.option("--filter", "filters", multiple=True, metavar="KEY=VALUE",
              help="experiment=GLOB, accelerator_type=TEXT (substring), num_accelerators=N. Repeatable.")
@common
def list_runs(all_status: bool, status_names: tuple[str, ...], limit: int, filters: tuple[str, ...]) -> None:
    """Runs, newest first."""
    wanted: Any = "all" if all_status else (parse_statuses(status_names) if status_names else None)
    store = RunStore()
    runs = store.list_runs(statuses=wanted, limit=limit, **_filters(filters))
    if settings().json:
        envelope({"runs": [{**run_dict(r), "queue": queue_dict(store, r)} for r in runs]})
        return
    if not runs:
        print("No runs." + ("" if all_status else " (--all-status shows ended runs too)"))
        return
    print_table(["RUN", "KIND", "STATUS", "EXPERIMENT", "ACCELERATORS", "SUBMITTED", "DURATION", "ATTEMPTS"], [
        [r.id, r.kind, r.status.value, r.experiment, f"{r.num_accelerators} × {r.accelerator_type}",
         fmt_time(r.submitted_at), fmt_duration(r.duration_seconds()), str(r.attempt_count)] for r in runs])
    waiting = [(r.id, queue_dict(store, r)) for r in runs if r.status is RunStatus.QUEUED]
    if waiting:
        print("\nWaiting:")
        for run_id, queue in waiting:
            print(f"  {run_id}  {queue['reason'] if queue else 'QUEUED'}")
