"""`ray.train.report(...)` metrics into the run's MLflow run, on by default under air.

Ray Train (v2, Ray's default since 2.51) instantiates the callbacks named in RAY_TRAIN_CALLBACKS
("module.Class", comma-separated) for every trainer the driver creates. air adds its own
`MlflowReportCallback` there when MLFLOW_RUN_ID is set: it runs in the Train controller and logs what
world rank 0 reported, at each report, to that MLflow run. Users change nothing in their script;
AIR_RAY_TRAIN_MLFLOW=0 turns it off.

Beside it, on every workload node, `AirTrainCallback`: it gives a trainer without its own
`RunConfig.storage_path` the run's checkpoint folder (AIR_CHECKPOINT_DIR) and a name that is the same in
every attempt, so `ray.train.get_checkpoint()` returns the last checkpoint in a retried attempt; and
each worker's `ray.train.report` counts as progress for its node (air.runtime.heartbeat()).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

from air.settings import AIR_RAY_TRAIN_MLFLOW

CALLBACK_PATH = "air.ray.train_callback.MlflowReportCallback"
TRAIN_CALLBACK_PATH = "air.ray.train_callback.AirTrainCallback"
CALLBACKS_ENV = "RAY_TRAIN_CALLBACKS"


def train_report_env(current: str | None = None, *, mlflow: bool = True, checkpoints: bool = False) -> dict[str, str]:
    """The RAY_TRAIN_CALLBACKS value with air's callbacks added (for a node's or a driver's environment):
    the MLflow one (`mlflow`), the checkpoint-and-progress one (`checkpoints`)."""
    names = [n.strip() for n in (current or "").split(",") if n.strip()]
    for wanted, on in ((CALLBACK_PATH, mlflow), (TRAIN_CALLBACK_PATH, checkpoints)):
        if on and wanted not in names:
            names.append(wanted)
    return {CALLBACKS_ENV: ",".join(names)}


def enable_train_report_logging(env: MutableMapping[str, str] | None = None) -> bool:
    """Add the callback to `env` (default: this process) when an MLflow run is set; True if added."""
    env = os.environ if env is None else env
    if not env.get("MLFLOW_RUN_ID") or env.get(AIR_RAY_TRAIN_MLFLOW, "1") == "0":
        return False
    env.update(train_report_env(env.get(CALLBACKS_ENV)))
    return True

