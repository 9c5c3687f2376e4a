"""Readings of this machine for system metrics: CPU, memory, and GPUs through NVML, under MLflow's names.

One reading code for every place that samples a node: the supervisor's sampler for the nodes on its own
machine (air.tracking.sysmetrics) and each Ray node's agent for its own host (air.backends.ray_agent), which
keeps its readings (`NodeSampler`) until the submitting side's next poll takes them. Nothing here imports
MLflow (an agent never loads it); psutil and pynvml are imported inside the methods that use them.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

#: Seconds between samples (the reference's sidecar samples every 2 s).
DEFAULT_INTERVAL_S = 2.0

#: Samples a node keeps for the submitting side before the oldest are dropped (an hour at 2 s).
MAX_KEPT_SAMPLES = 1800

#: One sample: (milliseconds since the epoch, metric name -> value).
Sample = tuple[int, dict[str, float]]


@dataclass
class NodeSamples:
    """What a node sampled of its own host since the last time they were taken (a Ray node's agent).

    `labels` say where: "host" (its hostname, the `air.host.node_<n>` tag) and further ones such as
    "ray_node_id" and "ip" (tagged `air.<label>.node_<n>`), so nodes on one machine can be told apart.
    `problem`: why the node's sampling stopped or lacks GPU readings ("" if nothing is wrong)."""

    labels: dict[str, str]
    samples: list[Sample] = field(default_factory=list)
    problem: str = ""


class MachineReader:
    """Reads this machine: its CPU use since the previous reading, its memory, and each node's own GPUs.

    `gpus` maps a node to the NVML indices of its GPUs (None: all of the machine's, [] none); they are named
    `gpu_0`, `gpu_1`, ... in that order, the node's `LOCAL_RANK` device numbering. `open()` before `read()`,
    `close()` after.
    """

    def __init__(self, gpus: Mapping[int, Sequence[int] | None], warn: Callable[[str], None] | None = None,
                 what: str = "this node") -> None:
        self.nodes: dict[int, list[int] | None] = {n: list(g) if g is not None else None for n, g in gpus.items()}
        self.warn = warn or (lambda _line: None)
        self.what = what
        self._gpus: dict[int, list[object]] = {}  # pynvml's device handles, per node
        self._nvml = False
        self._cpu_last: tuple[float, float] | None = None

    def open(self) -> None:
        """Prime the CPU reading (the first `read()` covers the time since) and open the GPUs' handles."""
        self._cpu_percent()
        self._init_gpus()

    def close(self) -> None:
        if self._nvml:
            try:
                import pynvml

                pynvml.nvmlShutdown()
            except Exception:
                pass
            self._nvml = False

    def read(self) -> dict[int, dict[str, float]]:
        """One reading of the machine, shared by its nodes, plus each node's own GPUs (rounded to 0.01)."""
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
        """Machine CPU use since this reader's previous reading.

        Not `psutil.cpu_percent(None)`: its "since last call" state is global to the process, so two
        readers in one process would cut each other's intervals.
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

    def _init_gpus(self) -> None:
        """NVML handles of each node's GPUs; none (silently) on a machine without NVIDIA GPUs."""
        if all(indices == [] for indices in self.nodes.values()):
            return  # CPU nodes: NVML is not even loaded
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
            self.warn(f"tracking: no GPU metrics for {self.what}: {first_line(exc)}")
            self._gpus = {}


class Periodic:
    """A daemon thread that calls `tick()` every `interval_s` (`wait_s()`), and once more when stopped;
    `tick()` returning False ends it (a failed sampling never fails what it samples). `start()` and `stop()`
    may each be called again: the second does nothing."""

    def __init__(self, interval_s: float, thread_name: str) -> None:
        self.interval_s = interval_s
        self._thread_name = thread_name
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            return
        self.opening()
        self._thread = threading.Thread(target=self._run, name=self._thread_name, daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        thread.join(timeout_s)
        self.closing()

    def opening(self) -> None:
        """Before the thread starts (a reader primed, so the first tick covers the time since start())."""

    def closing(self) -> None:
        """After the thread ended."""

    def wait_s(self) -> float:
        return self.interval_s

    def tick(self) -> bool:
        raise NotImplementedError

    def _run(self) -> None:
        while True:
            stopping = self._stop.wait(self.wait_s())
            if not self.tick() or stopping:
                return


class NodeSampler(Periodic):
    """Samples this host for one node every `interval_s` in a daemon thread, keeping the newest
    MAX_KEPT_SAMPLES (timestamp ms, metrics) until `take()` hands them over (a Ray node's agent: they ride on
    its poll replies). `stop()` takes one last sample (what was sampled stays for `take()`). A failed reading
    ends sampling; `error` says why."""

    def __init__(self, gpu_indices: Sequence[int], interval_s: float = DEFAULT_INTERVAL_S,
                 max_kept: int = MAX_KEPT_SAMPLES) -> None:
        super().__init__(interval_s, "air-node-sysmetrics")
        self.error = ""
        self._warnings: list[str] = []
        self._reader = MachineReader({0: list(gpu_indices)}, warn=self._warnings.append)
        self._samples: deque[Sample] = deque(maxlen=max_kept)
        self._lock = threading.Lock()

    @classmethod
    def started(cls, gpu_indices: Sequence[int]) -> NodeSampler:
        """A sampler of this host for a node, sampling; one that could not start says why in `error` (the node
        runs without system metrics, and the submitting side is told)."""
        sampler = cls(gpu_indices)
        try:
            sampler.start()
        except Exception as exc:
            sampler.error = f"tracking: no system metrics: {type(exc).__name__}: {exc}"
        return sampler

    def opening(self) -> None:
        self._reader.open()

    def closing(self) -> None:
        self._reader.close()

    def take(self) -> list[Sample]:
        """The samples not yet taken, oldest first."""
        with self._lock:
            out = list(self._samples)
            self._samples.clear()
        return out

    def problems(self) -> str:
        """Why sampling stopped or GPU readings are missing ("" if nothing is wrong)."""
        return "; ".join([*self._warnings, *([self.error] if self.error else [])])

    def tick(self) -> bool:
        try:
            metrics = self._reader.read()[0]
        except Exception as exc:  # sampling never fails a node
            self.error = f"tracking: system metrics stopped: {first_line(exc)}"
            return False
        with self._lock:
            self._samples.append((int(time.time() * 1000), metrics))
        return True


def first_line(exc: BaseException, limit: int = 300) -> str:
    """An exception as one bounded line (a warning, not a traceback)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


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

