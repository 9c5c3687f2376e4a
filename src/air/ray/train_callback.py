"""The Ray Train callback behind `air.backends.ray_train_report` (imports Ray Train: only loaded by Ray Train itself).

Callbacks named in RAY_TRAIN_CALLBACKS must be Ray Train's internal `RayTrainCallback`s; the report
hook among them is `ReportCallback.after_report(training_report, metrics)` (Ray 2.5x/2.60). The
arguments are taken by name and defensively, so a changed signature costs the metrics, not the run.
"""

from __future__ import annotations

import logging
import numbers
import os
import time
from typing import Any

from ray.train.v2._internal.execution.callback import ReportCallback

_log = logging.getLogger("air.ray.train")


class MlflowReportCallback(ReportCallback):
    """Logs world rank 0's `ray.train.report` metrics to MLFLOW_RUN_ID (read in the driver, where it is
    set; the callback then runs in the Train controller, possibly on another node)."""

    def __init__(self) -> None:
        self.run_id = os.environ.get("MLFLOW_RUN_ID")
        self.tracking_uri = os.environ.get("MLFLOW_TRACKING_URI")
        if self.run_id and not self.tracking_uri:
            try:
                from air.tracking.store import tracking_uri

                self.tracking_uri = tracking_uri()
            except Exception:  # noqa: BLE001 - MLflow's own default
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
        except Exception as exc:  # noqa: BLE001 - tracking never fails training; warn once
            self._failed = True
            _log.warning("air: could not log ray.train.report metrics to MLflow run %s: %s", self.run_id, exc)
