"""Per-node system metrics while an attempt runs: CPU, memory, and GPUs through NVML.

Why not MLflow's `SystemMetricsMonitor`: it stops as soon as the run is not RUNNING, and the user's
code ends the shared run at exit (MLflow's atexit `end_run`) while other nodes are still training; it
also batches metrics until its own flush heuristics fire. This sampler keeps MLflow's metric names (so
the UI's system-metrics charts look as usual) under per-node prefixes (`system/node_<n>/...`, as in the
reference), logs every sample, and is a daemon thread that `stop()` ends: it cannot keep a process
alive after the attempt.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from air.tracking.store import Warn, client, default_warn, http_limits, short_message, tracking_uri

#: Seconds between samples (the reference's sidecar samples every 2 s).
DEFAULT_INTERVAL_S = 2.0


class SystemMetricsSampler:
    """Samples this machine every `interval_s` and logs into `run_id` as `system/node_<n>/<name>`.

    `gpu_indices` are the NVML indices of the node's GPUs (None: all); they are logged as `gpu_0`,
    `gpu_1`, ... in that order, which is the node's `LOCAL_RANK` device numbering.
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
    ) -> None:
        self.run_id = run_id
        self.node_rank = node_rank
        self.interval_s = interval_s
        self.tracking_uri = tracking_uri or _default_uri()
        self.gpu_indices = list(gpu_indices) if gpu_indices is not None else None
        self.warn = warn or default_warn
        self.prefix = f"system/node_{node_rank}/"
        self.step = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._gpus: list[Any] = []
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
        self._thread = threading.Thread(
            target=self._loop, name=f"air-sysmetrics-node{self.node_rank}", daemon=True
        )
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

    def sample(self) -> dict[str, float]:
        """One reading, with MLflow's metric names (no prefix)."""
        import psutil

        mem = psutil.virtual_memory()
        metrics: dict[str, float] = {
            "cpu_utilization_percentage": self._cpu_percent(),
            "system_memory_usage_megabytes": mem.used / 1e6,
            "system_memory_usage_percentage": mem.used / mem.total * 100,
        }
        for i, handle in enumerate(self._gpus):
            metrics.update(_gpu_sample(i, handle))
        return {k: round(v, 2) for k, v in metrics.items()}

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
                metrics = self.sample()
            except Exception as exc:
                self.warn(f"tracking: system metrics of node {self.node_rank} stopped: {exc}")
                return
            self._log(metrics)
            if stopping or self._failed:
                return

    def _log(self, metrics: dict[str, float]) -> None:
        """Log one sample as one batch at the next step; a failure stops sampling with a warning."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(self.prefix + k, v, now, self.step) for k, v in metrics.items()]
        try:
            with http_limits(self.tracking_uri):
                client(self.tracking_uri).log_batch(self.run_id, metrics=batch)
        except Exception as exc:
            self._failed = True
            self.warn(f"tracking: system metrics of node {self.node_rank} stopped: {short_message(exc)}")
            return
        self.step += 1

    def _init_gpus(self) -> None:
        """NVML handles of the node's GPUs; none (silently) on a machine without NVIDIA GPUs."""
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception:
            return
        self._nvml = True
        try:
            indices = self.gpu_indices
            if indices is None:
                indices = list(range(pynvml.nvmlDeviceGetCount()))
            self._gpus = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in indices]
        except Exception as exc:
            self.warn(f"tracking: no GPU metrics for node {self.node_rank}: {short_message(exc)}")
            self._gpus = []


def _gpu_sample(i: int, handle: Any) -> dict[str, float]:
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
