"""One MLflow run per `@distributed` call, made in the caller's process (often a notebook).

Only `MlflowClient` is used here, never the fluent API: the caller's active run, active experiment and
environment are exactly as they were after the call. The ranks get `handle.env()` in their own
environment; it must not be written into the caller's `os.environ`.

Where the run goes, in order:
- the caller's active run (`mlflow.active_run()`), else a run named by `MLFLOW_RUN_ID` (a call made
  inside an air workload node): the call run is nested under it, in its experiment;
- the experiment set with `mlflow.set_experiment(...)`, else `MLFLOW_EXPERIMENT_ID` /
  `MLFLOW_EXPERIMENT_NAME`, else `DEFAULT_CALL_EXPERIMENT`.
The store is the caller's MLflow store when the caller configured or used MLflow in this process
(a tracking URI, an active run, an active experiment), else air's default (`tracking_uri()`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from air.tracking.handle import TrackingHandle
from air.tracking.params import clean_tags
from air.tracking.store import (
    SHOW_LOGS_TAG,
    Warn,
    client,
    default_warn,
    get_or_create_experiment,
    http_limits,
    os_user,
    short_message,
    tracking_uri,
)

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Run

#: Experiment of calls made with no experiment chosen.
DEFAULT_CALL_EXPERIMENT = "air-distributed"

#: MLflow's tag linking a child run to its parent (what `start_run(nested=True)` writes).
PARENT_RUN_TAG = "mlflow.parentRunId"


def start_call_run(
    func_name: str,
    tags: Mapping[str, object] | None = None,
    warn: Warn | None = None,
    *,
    run_name: str | None = None,
) -> TrackingHandle | None:
    """Create the MLflow run of one `@distributed` call; None (with a warning) when unavailable."""
    warn = warn or default_warn
    uri = tracking_uri()
    try:
        import mlflow
        from mlflow.tracking import fluent

        active = mlflow.active_run()
        active_exp = getattr(fluent, "_active_experiment_id", None)  # set by mlflow.set_experiment
        if active is not None or active_exp or mlflow.is_tracking_uri_set():
            uri = mlflow.get_tracking_uri()
        with http_limits(uri):
            mlflow_client = client(uri)
            parent_id, exp_id = _parent_and_experiment(mlflow_client, active, active_exp, uri, warn)
            run_tags: dict[str, object] = {"mlflow.user": os_user(), **dict(tags or {})}
            if parent_id:
                run_tags[PARENT_RUN_TAG] = parent_id
            run = mlflow_client.create_run(
                exp_id, run_name=run_name or func_name, tags=clean_tags(run_tags, warn)
            )
    except Exception as exc:
        warn(
            f"tracking: could not create an MLflow run for {func_name} at {uri}: "
            f"{short_message(exc)}; the call runs without MLflow tracking"
        )
        return None
    return TrackingHandle(run.info.run_id, exp_id, uri, warn)


def _parent_and_experiment(
    mlflow_client: MlflowClient, active: Run | None, active_exp: str | None, uri: str, warn: Warn
) -> tuple[str | None, str]:
    """The run to nest under (if any) and the experiment id the call run goes into."""
    parent = active
    if parent is None and (env_run := os.environ.get("MLFLOW_RUN_ID")):
        try:
            parent = mlflow_client.get_run(env_run)
        except Exception as exc:
            warn(f"tracking: not nesting under MLFLOW_RUN_ID={env_run}: {short_message(exc)}")
    if parent is not None:
        parent_id: str | None = parent.info.run_id
        exp_id = parent.info.experiment_id
    elif active_exp:
        parent_id, exp_id = None, active_exp
    elif env_exp := os.environ.get("MLFLOW_EXPERIMENT_ID"):
        parent_id, exp_id = None, mlflow_client.get_experiment(env_exp).experiment_id
    else:
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_CALL_EXPERIMENT
        return None, get_or_create_experiment(mlflow_client, uri, name, warn).experiment_id
    exp = mlflow_client.get_experiment(exp_id)
    if exp.tags.get(SHOW_LOGS_TAG) != "true":
        try:
            mlflow_client.set_experiment_tag(exp_id, SHOW_LOGS_TAG, "true")
        except Exception as exc:
            warn(f"tracking: could not tag experiment {exp_id}: {short_message(exc)}")
    return parent_id, exp_id
