"""`air get run ID` and `air list runs`."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import click

from air.cli.main import common, settings
from air.cli.output import envelope, fmt_duration, fmt_time, print_fields, print_table
from air.errors import UserInputError
from air.runs.states import statuses as parse_statuses
from air.runs.store import Run, RunStore


def run_dict(run: Run) -> dict[str, Any]:
    data = asdict(run)
    data.pop("spec_yaml", None)
    data["status"] = run.status.value
    data["failure_class"] = run.failure_class.value if run.failure_class else None
    data["duration_seconds"] = run.duration_seconds()
    data["attempts"] = run.attempt_count
    return data


def mlflow_link(run: Run) -> str | None:
    """A link into the MLflow UI for the run's latest attempt (the supervisor notes the experiment)."""
    import json

    from air.runs.paths import RunPaths

    if not run.mlflow_run_id or run.current_attempt is None:
        return None
    try:
        info = json.loads((RunPaths(run.id).attempt_dir(run.current_attempt) / "tracking.json").read_text())
        if not info.get("tracking_uri", "").startswith("sqlite"):
            base = info["tracking_uri"].rstrip("/")
            return f"{base}/#/experiments/{info['experiment_id']}/runs/{info['run_id']}"
        from air.tracking import run_url

        return run_url(info["run_id"], info["experiment_id"])
    except Exception:
        return None


@click.group()
def get() -> None:
    """Show one object in detail."""


@get.command("run")
@click.argument("run_id")
@common
def get_run(run_id: str) -> None:
    """A run: status, attempts, termination reason, MLflow run, logs."""

    store = RunStore()
    run = store.get_run(run_id)
    attempts = store.list_attempts(run.id)
    link = mlflow_link(run)
    if settings().json:
        data = run_dict(run)
        data["mlflow_url"] = link
        data["attempt_list"] = [
            {**asdict(a), "status": a.status.value, "failure_class": a.failure_class.value if a.failure_class else None}
            for a in attempts]
        data["folder"] = str(run_folder(run))
        if run.kind == "call":
            data["rank_logs"] = call_rank_logs(run)
        envelope(data)
        return
    pairs = [
        ("Run", run.id), ("Status", run.status.value), ("Experiment", run.experiment),
        ("MLflow run name", run.run_name or run.experiment),
        ("Accelerators", f"{run.num_accelerators} × {run.accelerator_type} ({run.num_nodes} node(s))"),
        ("Backend", f"{run.backend} (profile {run.profile or 'local'})"), ("User", run.user or "-"),
        ("Submitted", fmt_time(run.submitted_at)), ("Started", fmt_time(run.started_at)),
        ("Ended", fmt_time(run.ended_at)), ("Duration", fmt_duration(run.duration_seconds())),
        ("Attempts", f"{run.attempt_count} (retries: {max(run.attempt_count - 1, 0)})"),
    ]
    if run.termination_reason and not run.status.value == "SUCCESS":
        pairs.append(("Termination reason", run.termination_reason))
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


def run_folder(run: Run) -> Path:
    """Where a run's files are: a local call's call folder, any other run's run folder."""
    from air.runs.paths import CallPaths, RunPaths

    return CallPaths(run.id).folder if run.kind == "call" and run.backend == "local" else RunPaths(run.id).folder


def call_rank_logs(run: Run) -> list[dict[str, Any]]:
    """A call's rank logs, by rank: where `air logs ID --rank N` reads (and whether it exists yet)."""
    from air.runs.paths import CallPaths

    paths = CallPaths(run.id)
    return [{"rank": r, "path": str(paths.rank_log(r)), "exists": paths.rank_log(r).exists()}
            for r in range(run.num_accelerators)]


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
    runs = RunStore().list_runs(statuses=wanted, limit=limit, **_filters(filters))
    if settings().json:
        envelope({"runs": [run_dict(r) for r in runs]})
        return
    if not runs:
        print("No runs." + ("" if all_status else " (--all-status shows ended runs too)"))
        return
    print_table(["RUN", "KIND", "STATUS", "EXPERIMENT", "ACCELERATORS", "SUBMITTED", "DURATION", "ATTEMPTS"], [
        [r.id, r.kind, r.status.value, r.experiment, f"{r.num_accelerators} × {r.accelerator_type}",
         fmt_time(r.submitted_at), fmt_duration(r.duration_seconds()), str(r.attempt_count)] for r in runs])
