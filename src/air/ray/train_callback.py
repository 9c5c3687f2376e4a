"""The Ray Train callback behind `air.backends.ray_train_report` (imports Ray Train: only loaded by Ray Train itself).

Callbacks named in RAY_TRAIN_CALLBACKS must be Ray Train's internal `RayTrainCallback`s; the report
hook among them is `ReportCallback.after_report(training_report, metrics)` (Ray 2.5x/2.60). The
arguments are taken by name and defensively, so a changed signature costs the metrics, not the run.
"""

from __future__ import annotations

import logging
import numbers
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, Protocol

from ray.train.v2._internal.execution.callback import ReportCallback, TrainContextCallback

_log = logging.getLogger("air.ray.train")


class MlflowReportCallback(ReportCallback):
    """Logs world rank 0's `ray.train.report` metrics to MLFLOW_RUN_ID (read in the driver, where it is
    set; the callback then runs in the Train controller, possibly on another node)."""

    def __init__(self) -> None:
        if not os.environ.get("MLFLOW_RUN_ID") and _active_run_id() is None:
            from air.distributed.mlflow_gate import use_mlflow

            use_mlflow()  # a lazily tracked call's run may still be in the making: wait for it (no-op otherwise)
        self.run_id = os.environ.get("MLFLOW_RUN_ID") or _active_run_id()
        self.tracking_uri = os.environ.get("MLFLOW_TRACKING_URI")
        if self.run_id and not self.tracking_uri:
            try:
                from air.tracking.store import tracking_uri

                self.tracking_uri = tracking_uri()
            except Exception:  # MLflow's own default
                self.tracking_uri = None
        self.reports = 0
        self._failed = False

    def after_report(self, *args: Any, **kwargs: Any) -> None:
        metrics = kwargs.get("metrics", args[1] if len(args) > 1 else None)
        if not self.run_id or not metrics or self._failed:
            return
        first = metrics[0] or {}
        values = {k: float(v) for k, v in first.items()
                  if isinstance(v, numbers.Real) and not isinstance(v, bool)}
        step = int(values["step"]) if "step" in values else self.reports
        self.reports += 1
        if not values:
            return
        try:
            from mlflow import MlflowClient
            from mlflow.entities import Metric

            now = int(time.time() * 1000)
            MlflowClient(self.tracking_uri).log_batch(
                self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])
        except Exception as exc:  # tracking never fails training; warn once
            self._failed = True
            _log.warning("air: could not log ray.train.report metrics to MLflow run %s: %s", self.run_id, exc)


def _active_run_id() -> str | None:
    """The driver's active MLflow run: MLflow's `start_run` (also implied by a first `mlflow.log_metric`)
    takes MLFLOW_RUN_ID out of the environment, so a driver that logged before `fit()` has only this."""
    mlflow = sys.modules.get("mlflow")
    try:
        run = mlflow.active_run() if mlflow is not None else None
    except Exception:  # no fluent state worth using
        return None
    return str(run.info.run_id) if run is not None else None


class AirTrainCallback(TrainContextCallback):
    """Checkpoints that outlive attempts, and reports as progress (see air.backends.ray_train_report).

    Made in the driver when a trainer's `fit()` starts: a trainer whose `RunConfig` kept Ray's defaults
    (`storage_path` ~/ray_results, a dated `name`) gets AIR_CHECKPOINT_DIR and a name the same in every
    attempt of the run, before Ray Train opens its storage, so a retried attempt finds its checkpoints
    and `ray.train.get_checkpoint()` returns the latest. Copied to every worker, where each
    `ray.train.report` is a heartbeat for the worker's node."""

    def __init__(self) -> None:
        self.applied = _apply_checkpoint_defaults()

    @contextmanager
    def on_report(self) -> Iterator[None]:
        try:
            from air.runtime import heartbeat

            heartbeat()
        except Exception:  # progress notes never fail training
            pass
        yield


def _apply_checkpoint_defaults() -> bool:
    """Give the calling trainer's RunConfig the run's checkpoint folder and a stable name; True if done."""
    from air.settings import AIR_CHECKPOINT_DIR, AIR_RUN_ID

    location = os.environ.get(AIR_CHECKPOINT_DIR)
    if not location:
        return False
    config = _calling_trainer_config()
    if config is None or "storage_context" in vars(config):  # not found, or its storage is already open
        return False
    from ray.train.constants import DEFAULT_STORAGE_PATH

    if config.storage_path not in (None, DEFAULT_STORAGE_PATH) or config.storage_filesystem is not None:
        return False  # the user chose where checkpoints go
    config.storage_path = location
    if not config.name or str(config.name).startswith("ray_train_run-"):
        config.name = f"air-{os.environ.get(AIR_RUN_ID) or 'run'}"
    _log.info("air: Ray Train checkpoints go to %s/%s (AIR_CHECKPOINT_DIR)", config.storage_path, config.name)
    return True


class _TrainerRunConfig(Protocol):
    """What air sets of a Ray Train RunConfig (found up the stack, so either Train version's)."""

    storage_path: str | None
    storage_filesystem: object
    name: str | None


def _calling_trainer_config() -> _TrainerRunConfig | None:
    """The RunConfig of the trainer whose `fit()` is creating this callback (Ray Train makes the
    callbacks named in RAY_TRAIN_CALLBACKS from inside it), found up the call stack."""
    frame: FrameType | None = sys._getframe(2)
    for _ in range(20):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        config = getattr(owner, "run_config", None)
        if config is not None and hasattr(config, "storage_path") and hasattr(owner, "fit"):
            return config
        frame = frame.f_back
    return None
