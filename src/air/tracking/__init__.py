"""MLflow tracking for air: the embedded default store, one MLflow run per attempt or call, node and
rank logs as artifacts, per-node system metrics, and `air ui`.

Importing this package does not import MLflow (it costs over a second); each function imports it when
it first talks to a store. Every function that talks to MLflow turns a failure into a warning through
the caller's `warn` callback and returns None / False: tracking never decides whether training runs.
"""

from __future__ import annotations

from air.tracking.attempt import attempt_tags, log_params, start_attempt_run
from air.tracking.call import DEFAULT_CALL_EXPERIMENT, start_call_run
from air.tracking.handle import END_STATUSES, EndStatus, TrackingHandle
from air.tracking.params import flatten_params
from air.tracking.store import (
    artifact_root,
    embedded_uri,
    is_embedded,
    prepare_store,
    tracking_enabled,
    tracking_uri,
)
from air.tracking.sysmetrics import SystemMetricsSampler
from air.tracking.ui import run_url, ui_base_url

__all__ = [
    "tracking_enabled",
    "DEFAULT_CALL_EXPERIMENT",
    "END_STATUSES",
    "EndStatus",
    "SystemMetricsSampler",
    "TrackingHandle",
    "artifact_root",
    "attempt_tags",
    "embedded_uri",
    "flatten_params",
    "is_embedded",
    "log_params",
    "prepare_store",
    "run_url",
    "start_attempt_run",
    "start_call_run",
    "tracking_uri",
    "ui_base_url",
]
