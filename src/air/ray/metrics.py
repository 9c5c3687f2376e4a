"""`RayMetricsMonitor`: Ray's own metrics (tasks, actors, object store, per-component CPU/memory) in
the run's MLflow run, next to the training metrics.

Every Ray node serves Prometheus text on its metrics export port. A daemon thread scrapes it every
`sampling_interval` seconds, keeps a small set of families worth a chart (the cluster-wide ones on
the head only, so they are not counted once per node), and logs them with one `log_batch` per sample
under `system/ray/<family>/<label values>`. It stops on `finish()` or once the MLflow run is no
longer RUNNING. A failing scrape or MLflow call is logged and skipped: metrics never fail a run.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
import urllib.request
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlflow import MlflowClient

from air.launcher.machine import Periodic
from air.settings import AIR_RAY_METRICS_PORT

_log = logging.getLogger("air.ray.metrics")

#: Cluster-wide families: logged by the head node's monitor only.
GLOBAL_FAMILIES = ("ray_tasks", "ray_actors", "ray_placement_groups", "ray_cluster_active_nodes",
                   "ray_cluster_failed_nodes", "ray_cluster_pending_nodes")
#: Per-node families: logged by every node's monitor, under the node's name.
NODE_FAMILIES = ("ray_resources", "ray_object_store_memory", "ray_component_cpu_percentage",
                 "ray_component_uss_mb", "ray_node_disk_io_write_speed", "ray_node_disk_io_read_speed",
                 "ray_node_network_receive_speed", "ray_node_network_send_speed", "ray_node_gpus_utilization",
                 "ray_node_gram_used", "ray_node_mem_used", "ray_node_cpu_utilization")
#: Labels that say nothing a chart needs (same value everywhere, or internal).
_DROP_LABELS = {"SessionName", "Version", "NodeAddress", "WorkerId", "JobId", "instance", "ip", "pid",
                "otel_scope_name", "otel_scope_schema_url", "otel_scope_version"}
_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_UNSAFE = re.compile(r"[^A-Za-z0-9_\-. /]")


def parse_prometheus(text: str, families: Iterable[str]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(family, labels) → value for the samples of `families` in Prometheus text (summed over dropped labels)."""
    wanted = set(families)
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _LINE.match(line)
        if not match or match.group(1) not in wanted:
            continue
        try:
            value = float(match.group(4))
        except ValueError:
            continue
        if value != value:  # NaN
            continue
        labels = tuple(sorted((k, v) for k, v in _LABEL.findall(match.group(3) or "") if k not in _DROP_LABELS))
        key = (match.group(1), labels)
        out[key] = out.get(key, 0.0) + value
    return out


def metric_key(prefix: str, family: str, labels: tuple[tuple[str, str], ...]) -> str:
    """`system/ray/ray_tasks/RUNNING/train_fn`: label values in label-name order, MLflow-safe."""
    values = [_UNSAFE.sub("_", v.rstrip("/").rsplit("/", 1)[-1]) for _, v in labels if v.strip("/")]
    return "/".join([prefix, family, *(v for v in values if v)])[:250]


class RayMetricsMonitor(Periodic):
    """Scrapes this node's Ray metrics into an MLflow run (see the module docstring).

    With no arguments it works in any process of an air node that runs Ray: `run_id` defaults to
    MLFLOW_RUN_ID (or MLflow's active run), found once the thread starts (a workload node's run may be
    made after its processes start); `metrics_url` to this node's export port as air publishes it
    (AIR_RAY_METRICS_PORT in `ray_launch`, the `ray` shim's file in a workload node's RAY_TMPDIR, else
    this node's entry in `ray.nodes()` once the process called `ray.init`); `is_head_node` to what the
    shim recorded, else NODE_RANK 0; `node_name` (default `node_<NODE_RANK>`) separates per-node metrics.
    """

    def __init__(self, run_id: str | None = None, is_head_node: bool | None = None, sampling_interval: float = 10,
                 *, metrics_url: str | None = None, tracking_uri: str | None = None,
                 node_name: str | None = None) -> None:
        super().__init__(float(sampling_interval), "air-ray-metrics")
        self.run_id = run_id
        self.sampling_interval = float(sampling_interval)
        info = _shim_node_info()
        if is_head_node is None:
            head = info.get("head") if info else None
            is_head_node = head if isinstance(head, bool) else os.environ.get("NODE_RANK", "0") in ("", "0")
        self.is_head_node = is_head_node
        self.metrics_url = metrics_url or _metrics_url(info)
        self.tracking_uri = tracking_uri
        self.node_name = node_name or f"node_{os.environ.get('NODE_RANK', '0')}"
        self._client_now: MlflowClient | None = None
        self._step = 0
        self.samples_logged = 0
        self.last_error: str | None = None

    def _client(self) -> MlflowClient:
        """Imported lazily: mlflow loads only in a process that logs Ray's metrics. (In a workload node the
        import is also what gives this process the attempt's MLFLOW_RUN_ID: air/tracking/node_hook.py.)"""
        import mlflow
        from mlflow import MlflowClient

        if self.run_id is None:
            active = mlflow.active_run()
            self.run_id = os.environ.get("MLFLOW_RUN_ID") or (active.info.run_id if active else None)
        self.tracking_uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if self.tracking_uri is None:
            try:
                from air.tracking.store import tracking_uri

                self.tracking_uri = tracking_uri()
            except Exception:  # plain MLflow default
                pass
        return MlflowClient(self.tracking_uri)

    def start(self) -> None:
        """Start sampling in a daemon thread (idempotent)."""
        self.metrics_url = self.metrics_url or _metrics_url(_shim_node_info())
        if self.metrics_url is None:
            _log.warning("RayMetricsMonitor: no Ray metrics port found (no AIR_RAY_METRICS_PORT, no Ray started by "
                         "air's `ray` shim on this node, no `ray.init` in this process); pass metrics_url=; "
                         "not started")
            return
        super().start()

    def finish(self, timeout: float = 10.0) -> None:
        """Take one last sample and stop."""
        self.stop(timeout)

    def wait_s(self) -> float:
        return self.sampling_interval if self.samples_logged else 1.0

    def sample(self) -> dict[str, float]:
        """One scrape, as MLflow keys → values (no logging)."""
        assert self.metrics_url is not None
        with urllib.request.urlopen(self.metrics_url, timeout=10) as response:
            text = response.read().decode("utf-8", errors="replace")
        values: dict[str, float] = {}
        if self.is_head_node:
            for (family, labels), value in parse_prometheus(text, GLOBAL_FAMILIES).items():
                values[metric_key("system/ray", family, labels)] = value
        for (family, labels), value in parse_prometheus(text, NODE_FAMILIES).items():
            if family == "ray_resources" and dict(labels).get("Name") not in ("GPU", "CPU"):
                continue
            values[metric_key(f"system/ray/{self.node_name}", family, labels)] = value
        return values

    def log_sample(self, client: MlflowClient | None = None) -> int:
        """Scrape once and log it; returns how many metrics were logged."""
        from mlflow.entities import Metric

        client = client or self._client()
        assert self.run_id is not None, "RayMetricsMonitor: no MLflow run to log to (pass run_id=)"
        values = self.sample()
        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, self._step) for key, value in values.items()]
        if not metrics:  # Ray's metrics agent exports nothing yet (a node just started): not a sample
            return 0
        for start in range(0, len(metrics), 900):  # MLflow caps a batch at 1000 metrics
            client.log_batch(self.run_id, metrics=metrics[start : start + 900])
        self._step += 1
        self.samples_logged += 1
        return len(metrics)

    def _run_is_running(self, client: MlflowClient) -> bool:
        try:
            return client.get_run(str(self.run_id)).info.status == "RUNNING"
        except Exception:  # unknown: keep going
            return True

    def tick(self) -> bool:
        try:
            client = self._client_now = self._client_now or self._client()
            if self.run_id is None:
                _log.warning("RayMetricsMonitor: no MLflow run (MLFLOW_RUN_ID unset, no active run); pass run_id=; "
                             "stopped")
                self.last_error = "no MLflow run"
                return False
            if not self._run_is_running(client):
                return False
            self.log_sample(client)
            self.last_error = None
        except Exception as exc:  # metrics never fail a run
            if self.last_error is None:
                _log.warning("RayMetricsMonitor: %s: %s", type(exc).__name__, exc)
            self.last_error = f"{type(exc).__name__}: {exc}"
        return True


def _shim_node_info() -> dict[str, object] | None:
    """This node's Ray as air's `ray` shim started it in a workload node (None elsewhere)."""
    if not os.environ.get("RAY_TMPDIR"):
        return None
    from air.backends.ray_shim import node_info

    return node_info(os.environ)


def _metrics_url(info: dict[str, object] | None) -> str | None:
    """This node's metrics endpoint: AIR_RAY_METRICS_PORT (ray_launch), the shim's record, else (a process
    that already called `ray.init`) this node's MetricsExportPort in `ray.nodes()`."""
    port = os.environ.get(AIR_RAY_METRICS_PORT) or (info or {}).get("metrics_export_port")
    if port:
        return f"http://127.0.0.1:{port}/metrics"
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    try:
        node_id = ray.get_runtime_context().get_node_id()
        for node in ray.nodes():
            if node.get("NodeID") == node_id and node.get("MetricsExportPort"):
                return f"http://{node.get('NodeManagerAddress') or '127.0.0.1'}:{node['MetricsExportPort']}/metrics"
    except Exception as exc:  # metrics never fail a run
        _log.warning("RayMetricsMonitor: Ray's node list: %s: %s", type(exc).__name__, exc)
    return None

