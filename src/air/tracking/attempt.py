"""One MLflow run per workload attempt: experiment, tags, parameters.

The supervisor calls `start_attempt_run` before it starts the nodes and hands `handle.env()` to each
node; the user's plain `mlflow.log_metric(...)` then lands in that run with no set-up. A retry is a new
attempt and so a new run in the same experiment, as in the reference.
"""

from __future__ import annotations

from collections.abc import Mapping

from air.tracking.handle import TrackingHandle
from air.tracking.params import MAX_PARAMS_PER_BATCH, clean_params, clean_tags
from air.tracking.store import (
    Warn,
    client,
    default_warn,
    get_or_create_experiment,
    http_limits,
    os_user,
    short_message,
    tracking_uri,
)


def attempt_tags(
    *,
    run_id: str,
    attempt: int,
    accelerator_type: str,
    num_accelerators: int,
    num_nodes: int,
    git_commit: str | None = None,
) -> dict[str, str]:
    """The tags every attempt run carries, named in one place (`air.run_id`, `air.attempt`, ...)."""
    tags = {
        "air.run_id": run_id,
        "air.attempt": str(attempt),
        "air.accelerator_type": accelerator_type,
        "air.num_accelerators": str(num_accelerators),
        "air.num_nodes": str(num_nodes),
    }
    if git_commit:
        tags["air.git_commit"] = git_commit
        tags["mlflow.source.git.commit"] = git_commit  # shown by the MLflow UI
    return tags


def start_attempt_run(
    experiment_name: str,
    run_name: str | None,
    tags: Mapping[str, object],
    params: Mapping[str, object],
    warn: Warn | None = None,
    timeout_s: int | None = None,
) -> TrackingHandle | None:
    """Create the MLflow run of one attempt; None (with a warning) when tracking is unavailable.
    `timeout_s`: a longer per-request limit than air's short one (a loaded server's answers take seconds).

    The experiment is created or appended to and tagged `air-show-logs=true`; the run is named
    `run_name` (default: the experiment name) and carries `tags` (see `attempt_tags`) and `params`
    (flattened with dots). A failure to log parameters keeps the run.
    """
    warn = warn or default_warn
    uri = tracking_uri()
    try:
        with http_limits(uri, timeout_s):
            mlflow_client = client(uri)
            exp = get_or_create_experiment(mlflow_client, uri, experiment_name, warn)
            run_tags = clean_tags({"mlflow.user": os_user(), **dict(tags)}, warn)
            run = mlflow_client.create_run(
                exp.experiment_id, run_name=run_name or experiment_name, tags=run_tags
            )
    except Exception as exc:
        warn(
            f"tracking: could not create an MLflow run in experiment {experiment_name!r} at "
            f"{uri}: {short_message(exc)}; the attempt runs without MLflow tracking"
        )
        return None
    handle = TrackingHandle(run.info.run_id, exp.experiment_id, uri, warn)
    log_params(handle, params)
    return handle


def log_params(handle: TrackingHandle, params: Mapping[str, object]) -> bool:
    """Log `params` into the handle's run in batches MLflow accepts; False on failure."""
    cleaned = clean_params(params, handle.warn)
    if not cleaned:
        return True

    def log() -> None:
        from mlflow.entities import Param

        mlflow_client = client(handle.tracking_uri)
        items = [Param(k, v) for k, v in cleaned.items()]
        for start in range(0, len(items), MAX_PARAMS_PER_BATCH):
            mlflow_client.log_batch(handle.run_id, params=items[start : start + MAX_PARAMS_PER_BATCH])

    return handle._call(f"log parameters to MLflow run {handle.run_id}", log)
