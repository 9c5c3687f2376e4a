"""Per-node system metrics while an attempt runs: CPU, memory, and GPUs through NVML.

One sampler serves every node of an attempt that runs on this machine: one thread, one reading of the
machine per interval and one `log_batch` for all of them (not a thread and a store connection per node:
at 16+ nodes those ran MLflow's connection pool dry and stalled the attempt's end). Each node is labelled
with the host it really runs on (the `air.host.node_<n>` tag).

Why not MLflow's `SystemMetricsMonitor`: it stops as soon as the run is not RUNNING, and the user's
code ends the shared run at exit (MLflow's atexit `end_run`) while other nodes are still training; it
also batches metrics until its own flush heuristics fire. This sampler keeps MLflow's metric names (so
the UI's system-metrics charts look as usual) under per-node prefixes (`system/node_<n>/...`, as in the
reference), logs every sample, and is a daemon thread that `stop()` ends: it cannot keep a process
alive after the attempt.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Mapping, Sequence

from air.tracking.store import Warn, client, default_warn, http_limits, short_message, tracking_uri

#: Seconds between samples (the reference's sidecar samples every 2 s).
DEFAULT_INTERVAL_S = 2.0


#: MLflow's limit on metrics in one `log_batch` call.
MAX_METRICS_PER_BATCH = 1000


class SystemMetricsSampler:
    """Samples this machine every `interval_s` and logs into `run_id` as `system/node_<n>/<name>`.

    `gpu_indices` are the NVML indices of the node's GPUs (None: all); they are logged as `gpu_0`,
    `gpu_1`, ... in that order, which is the node's `LOCAL_RANK` device numbering. `nodes` (node rank ->
    its GPU indices) makes one sampler serve several nodes of this machine instead of `node_rank`.
    """

    def __init__(
        self,
        run_id: str,
        node_rank: int,
        interval_s: float = DEFAULT_INTERVAL_S,
        *,
        tracking_uri: str | None = None,
        gpu_indices: Sequence[int] | None = None,
        warn: Warn | None = None,
        nodes: Mapping[int, Sequence[int] | None] | None = None,
    ) -> None:
        self.run_id = run_id
        self.nodes: dict[int, list[int] | None] = (
            {n: list(g) if g is not None else None for n, g in nodes.items()} if nodes
            else {node_rank: list(gpu_indices) if gpu_indices is not None else None})
        self.node_rank = min(self.nodes)
        self.interval_s = interval_s
        self.tracking_uri = tracking_uri or _default_uri()
        self.gpu_indices = self.nodes[self.node_rank]
        self.warn = warn or default_warn
        self.prefix = f"system/node_{self.node_rank}/"
        self.host = socket.gethostname()
        self.step = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._gpus: dict[int, list[object]] = {}  # pynvml's device handles, per node
        self._nvml = False
        self._failed = False
        self._cpu_last: tuple[float, float] | None = None

    # ---- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Begin sampling in a daemon thread; a second call does nothing."""
        if self._thread is not None:
            return
        self._cpu_percent()  # prime: the first reading covers the time since start()
        self._init_gpus()
        self._thread = threading.Thread(target=self._loop, name="air-sysmetrics", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Take one last sample, log it and end the thread (idempotent)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout_s)
        self._thread = None
        if self._nvml:
            try:
                import pynvml

                pynvml.nvmlShutdown()
            except Exception:
                pass
            self._nvml = False

    def __enter__(self) -> SystemMetricsSampler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- sampling ----------------------------------------------------------------------------------

    @property
    def what(self) -> str:
        """How warnings name the sampled nodes: "node 0", "nodes 0-31"."""
        ranks = sorted(self.nodes)
        if len(ranks) == 1:
            return f"node {ranks[0]}"
        if ranks == list(range(ranks[0], ranks[-1] + 1)):
            return f"nodes {ranks[0]}-{ranks[-1]}"
        return "nodes " + ",".join(map(str, ranks))

    def sample(self, node: int | None = None) -> dict[str, float]:
        """One reading of `node` (default: the first), with MLflow's metric names (no prefix)."""
        return self._sample_all()[self.node_rank if node is None else node]

    def _sample_all(self) -> dict[int, dict[str, float]]:
        """One reading of the machine, shared by its nodes, plus each node's own GPUs."""
        import psutil

        mem = psutil.virtual_memory()
        machine: dict[str, float] = {
            "cpu_utilization_percentage": self._cpu_percent(),
            "system_memory_usage_megabytes": mem.used / 1e6,
            "system_memory_usage_percentage": mem.used / mem.total * 100,
        }
        out = {}
        for node in self.nodes:
            metrics = dict(machine)
            for i, handle in enumerate(self._gpus.get(node, [])):
                metrics.update(_gpu_sample(i, handle))
            out[node] = {k: round(v, 2) for k, v in metrics.items()}
        return out

    def _cpu_percent(self) -> float:
        """Machine CPU use since this sampler's previous reading.

        Not `psutil.cpu_percent(None)`: its "since last call" state is global to the process, so two
        samplers in one supervisor (two local nodes) would cut each other's intervals.
        """
        import psutil

        t = psutil.cpu_times()
        total = sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)  # in user already
        idle = t.idle + getattr(t, "iowait", 0.0)
        last, self._cpu_last = self._cpu_last, (total, idle)
        if last is None or total <= last[0]:
            return 0.0
        busy = 1.0 - (idle - last[1]) / (total - last[0])
        return min(100.0, max(0.0, busy * 100.0))

    def _loop(self) -> None:
        """Sample, log, wait; the last sample is taken when `stop()` is called."""
        while True:
            stopping = self._stop.wait(self.interval_s)
            try:
                metrics = self._sample_all()
            except Exception as exc:
                self.warn(f"tracking: system metrics of {self.what} stopped: {exc}")
                return
            self._log(metrics)
            if stopping or self._failed:
                return

    def _log(self, metrics: dict[int, dict[str, float]]) -> None:
        """Log one sample of every node as one batch at the next step (the first also tags each node's
        host); a failure stops sampling with one warning."""
        from mlflow.entities import Metric, RunTag

        now = int(time.time() * 1000)
        batch = [Metric(f"system/node_{node}/{k}", v, now, self.step)
                 for node, values in metrics.items() for k, v in values.items()]
        tags = [RunTag(f"air.host.node_{node}", self.host) for node in metrics] if self.step == 0 else []
        try:
            with http_limits(self.tracking_uri):
                mlflow_client = client(self.tracking_uri)
                for start in range(0, max(len(batch), 1), MAX_METRICS_PER_BATCH):
                    mlflow_client.log_batch(self.run_id, metrics=batch[start : start + MAX_METRICS_PER_BATCH],
                                            tags=tags if start == 0 else [])
        except Exception as exc:
            self._failed = True
            self.warn(f"tracking: system metrics of {self.what} stopped: {short_message(exc)}")
            return
        self.step += 1

    def _init_gpus(self) -> None:
        """NVML handles of each node's GPUs; none (silently) on a machine without NVIDIA GPUs."""
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception:
            return
        self._nvml = True
        try:
            for node, indices in self.nodes.items():
                if indices is None:
                    indices = list(range(pynvml.nvmlDeviceGetCount()))
                self._gpus[node] = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in indices]
        except Exception as exc:
            self.warn(f"tracking: no GPU metrics for {self.what}: {short_message(exc)}")
            self._gpus = {}


def _gpu_sample(i: int, handle: object) -> dict[str, float]:
    """Utilisation, memory and power of one GPU; readings a GPU does not support are left out."""
    import pynvml

    out: dict[str, float] = {}
    try:
        util = pynvml.nvmlDeviceGetUtilizationRates(handle)
        out[f"gpu_{i}_utilization_percentage"] = float(util.gpu)
    except pynvml.NVMLError:
        pass
    try:
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        out[f"gpu_{i}_memory_usage_megabytes"] = mem.used / 1e6
        out[f"gpu_{i}_memory_usage_percentage"] = mem.used / mem.total * 100
    except pynvml.NVMLError:
        pass
    try:
        power_mw = pynvml.nvmlDeviceGetPowerUsage(handle)
        limit_mw = pynvml.nvmlDeviceGetEnforcedPowerLimit(handle)
        out[f"gpu_{i}_power_usage_watts"] = power_mw / 1000
        if limit_mw:
            out[f"gpu_{i}_power_usage_percentage"] = power_mw / limit_mw * 100
    except pynvml.NVMLError:
        pass
    return out


def _default_uri() -> str:
    """The node's tracking URI: the one air exported, else air's default."""
    return tracking_uri()
