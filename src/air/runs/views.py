"""What the CLI's `--json`, the server's API and the web pages show of a run: one query layer.

Every view is plain data (JSON-ready dicts) built from the run store; the CLI prints it, the server
returns it, the pages render it. The hosted CLI's field names sit beside air's own.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import asdict
from pathlib import Path
from typing import Any

from air.runs.paths import CallPaths, RunPaths
from air.runs.store import Run, RunStore


def rfc3339(ts: float | None) -> str | None:
    """Epoch seconds as an RFC 3339 UTC string, the form the hosted CLI's `started_at` has."""
    if ts is None:
        return None
    return _dt.datetime.fromtimestamp(ts, tz=_dt.timezone.utc).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z")


def run_dict(run: Run) -> dict[str, Any]:
    """A run for `--json`: the hosted CLI's field names and forms (reference §1.4: `run_id`, `run_name`,
    `started_at` as RFC 3339, `attempt_number`, `experiment_name`) beside air's own (`id`, `experiment`,
    `started_at_epoch`, ...), so scripts written for either read it."""
    data = asdict(run)
    data.pop("spec_yaml", None)
    data["status"] = run.status.value
    data["failure_class"] = run.failure_class.value if run.failure_class else None
    data["duration_seconds"] = run.duration_seconds()
    data["attempts"] = run.attempt_count
    data["run_id"] = run.id
    data["run_name"] = run.run_name or run.experiment  # the MLflow run name, as `get run` shows it
    data["experiment_name"] = run.experiment
    data["started_at_epoch"] = run.started_at
    data["started_at"] = rfc3339(run.started_at)
    data["attempt_number"] = run.current_attempt  # 0-based, as `air logs --retry` takes it
    return data


def queue_dict(store: RunStore, run: Run) -> dict[str, Any] | None:
    """The `queue` object of --json: why a QUEUED run waits (position, slots, holders, reason); None
    for a run that does not wait in a queue."""
    from air.runs.queue import queue_info

    info = queue_info(store, run)
    return None if info is None else info.to_dict()


def mlflow_link(run: Run) -> str | None:
    """A link into the MLflow UI for the run's latest attempt (the supervisor notes its MLflow run)."""
    from air.tracking.ui import tracking_ref_url

    if not run.mlflow_run_id or run.current_attempt is None:
        return None
    return tracking_ref_url(RunPaths(run.id).tracking(run.current_attempt))


def run_folder(run: Run) -> Path:
    """Where a run's files are: a local call's call folder, any other run's run folder."""
    return CallPaths(run.id).folder if run.kind == "call" and run.backend == "local" else RunPaths(run.id).folder


def call_rank_logs(run: Run) -> list[dict[str, Any]]:
    """A call's rank logs, by rank: where `air logs ID --rank N` reads (and whether it exists yet)."""
    paths = CallPaths(run.id)
    return [{"rank": r, "path": str(paths.rank_log(r)), "exists": paths.rank_log(r).exists()}
            for r in range(run.num_accelerators)]


def progress_view(run: Run) -> list[dict[str, Any]]:
    """Each node process of the current attempt with how long it has been quiet (no line, heartbeat or
    report), as the run controller last noted it (`attempt_<a>/progress.json`), aged to now while the
    run is active; `quiet` reads "node 1 quiet for 12m". Empty before any note."""
    import json
    import time

    from air.launcher.progress import quiet_for

    if run.current_attempt is None:
        return []
    try:
        noted = json.loads(RunPaths(run.id).progress(run.current_attempt).read_text())
    except (OSError, ValueError):
        return []
    age = max(time.time() - float(noted.get("at", 0.0)), 0.0) if not run.status.is_terminal() else 0.0
    out = []
    for proc in noted.get("processes", []):
        silent = float(proc.get("silent_s", 0.0)) + age
        out.append({**proc, "silent_s": round(silent, 1), "quiet": f"{proc.get('name')} quiet for {quiet_for(silent)}"})
    return out


def quiet_summary(progress: list[dict[str, Any]], at_least_s: float = 60.0) -> str | None:
    """"node 1 quiet for 12m; node 3 quiet for 2m" for the processes quiet for `at_least_s` or more."""
    quiet = [p["quiet"] for p in sorted(progress, key=lambda p: -p["silent_s"]) if p["silent_s"] >= at_least_s]
    return "; ".join(quiet) or None


def checkpoint_view(run: Run) -> dict[str, Any]:
    """The run's checkpoint location (AIR_CHECKPOINT_DIR, kept across attempts) and its latest checkpoint."""
    from air.runs.checkpoints import latest_checkpoint_of

    try:
        location = RunPaths(run.id).checkpoint_ref.read_text().strip() or None
    except OSError:
        location = None
    latest = latest_checkpoint_of(run.id, location) if location else None
    return {"checkpoint_dir": location, "latest_checkpoint": latest}


def run_detail(store: RunStore, run: Run) -> dict[str, Any]:
    """`air get run --json`: the run, its attempts, MLflow link, folder, queue place and (calls) rank logs."""
    data = run_dict(run)
    data["mlflow_url"] = mlflow_link(run)
    data["attempt_list"] = [
        {**asdict(a), "status": a.status.value, "failure_class": a.failure_class.value if a.failure_class else None}
        for a in store.list_attempts(run.id)]
    data["folder"] = str(run_folder(run))
    data["queue"] = queue_dict(store, run)
    data["progress"] = progress_view(run)
    data.update(checkpoint_view(run))
    if run.kind == "call":
        data["rank_logs"] = call_rank_logs(run)
    return data
