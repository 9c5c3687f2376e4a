"""Per-node system metrics while an attempt runs: CPU, memory, and GPUs through NVML.

Nodes on this machine (the local backend): one sampler serves every node of the attempt, one thread, one
reading of the machine per interval (air.launcher.machine's reader) and one `log_batch` for all of them
(not a thread and a store connection per node: at 16+ nodes those ran MLflow's connection pool dry and
stalled the attempt's end). Nodes elsewhere (a Ray node's agent): each node samples its own host with the
same reader and its samples ride on the agent's poll replies; `NodeMetricsLogger` logs what arrived, one
thread and one `log_batch` per interval for all nodes, with each sample's timestamp from its node. Either
way each node is labelled with the host it really runs on (the `air.host.node_<n>` tag).

Why not MLflow's `SystemMetricsMonitor`: it stops as soon as the run is not RUNNING, and the user's
code ends the shared run at exit (MLflow's atexit `end_run`) while other nodes are still training; it
also batches metrics until its own flush heuristics fire. These samplers keep MLflow's metric names (so
the UI's system-metrics charts look as usual) under per-node prefixes (`system/node_<n>/...`, as in the
reference), log every sample, and are daemon threads that `stop()` ends: they cannot keep a process
alive after the attempt.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from air.launcher.machine import DEFAULT_INTERVAL_S, MachineReader, NodeSamples, Periodic
from air.tracking.store import Warn, client, default_warn, http_limits, short_message, tracking_uri

if TYPE_CHECKING:
    from mlflow.entities import Metric, RunTag

#: MLflow's limit on metrics in one `log_batch` call.
MAX_METRICS_PER_BATCH = 1000

#: What a node-sampled attempt hands the logger: node rank -> what arrived from it since the last call
#: (None: its nodes are not sampled where they run, so this machine is sampled instead).
TakeSamples = Callable[[], Mapping[int, NodeSamples] | None]


def nodes_named(ranks: Sequence[int]) -> str:
    """How warnings name nodes: "node 0", "nodes 0-31", "nodes 1,3"."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"node {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"nodes {ranks[0]}-{ranks[-1]}"
    return "nodes " + ",".join(map(str, ranks))


class _BatchLogger(Periodic):
    """Logs metrics and tags into one MLflow run in `log_batch` calls, every `interval_s`; the first failure
    stops it, with one warning."""

    def __init__(self, run_id: str, tracking_uri: str | None, warn: Warn | None, interval_s: float,
                 thread_name: str) -> None:
        super().__init__(interval_s, thread_name)
        self.run_id = run_id
        self.tracking_uri = tracking_uri or _default_uri()
        self.warn = warn or default_warn
        self._failed = False

    @property
    def what(self) -> str:
        raise NotImplementedError

    def _send(self, batch: Sequence[Metric], tags: Sequence[RunTag]) -> bool:
        try:
            with http_limits(self.tracking_uri):
                mlflow_client = client(self.tracking_uri)
                for start in range(0, max(len(batch), 1), MAX_METRICS_PER_BATCH):
                    mlflow_client.log_batch(self.run_id, metrics=list(batch[start : start + MAX_METRICS_PER_BATCH]),
                                            tags=list(tags) if start == 0 else [])
        except Exception as exc:
            self._failed = True
            self.warn(f"tracking: system metrics of {self.what} stopped: {short_message(exc)}")
            return False
        return True


class SystemMetricsSampler(_BatchLogger):
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
        super().__init__(run_id, tracking_uri, warn, interval_s, "air-sysmetrics")
        self.nodes: dict[int, list[int] | None] = (
            {n: list(g) if g is not None else None for n, g in nodes.items()} if nodes
            else {node_rank: list(gpu_indices) if gpu_indices is not None else None})
        self.node_rank = min(self.nodes)
        self.gpu_indices = self.nodes[self.node_rank]
        self.prefix = f"system/node_{self.node_rank}/"
        self.host = socket.gethostname()
        self.step = 0
        self._reader = MachineReader(self.nodes, warn=self.warn, what=self.what)

    # ---- lifecycle (start() begins sampling; stop() takes one last sample, logs it, ends the thread) ------

    def opening(self) -> None:
        self._reader.open()

    def closing(self) -> None:
        self._reader.close()

    def __enter__(self) -> SystemMetricsSampler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- sampling ----------------------------------------------------------------------------------

    @property
    def what(self) -> str:
        """How warnings name the sampled nodes: "node 0", "nodes 0-31"."""
        return nodes_named(list(self.nodes))

    def sample(self, node: int | None = None) -> dict[str, float]:
        """One reading of `node` (default: the first), with MLflow's metric names (no prefix)."""
        return self._reader.read()[self.node_rank if node is None else node]

    def tick(self) -> bool:
        try:
            metrics = self._reader.read()
        except Exception as exc:
            self.warn(f"tracking: system metrics of {self.what} stopped: {exc}")
            return False
        self._log(metrics)
        return not self._failed

    def _log(self, metrics: dict[int, dict[str, float]]) -> None:
        """Log one sample of every node as one batch at the next step (the first also tags each node's
        host); a failure stops sampling with one warning."""
        from mlflow.entities import Metric, RunTag

        now = int(time.time() * 1000)
        batch = [Metric(f"system/node_{node}/{k}", v, now, self.step)
                 for node, values in metrics.items() for k, v in values.items()]
        tags = [RunTag(f"air.host.node_{node}", self.host) for node in metrics] if self.step == 0 else []
        if self._send(batch, tags):
            self.step += 1


class NodeMetricsLogger(_BatchLogger):
    """Logs the system metrics that nodes sampled of their own hosts (`take()`: what arrived since the last
    call, node rank -> NodeSamples), every `interval_s`, as one batch for all nodes: `system/node_<n>/<name>`
    at the node's own timestamps, steps counted per node, and on a node's first sample its labels as tags
    (`air.host.node_<n>`, `air.ray_node_id.node_<n>`, ...). A node's problem is warned once per attempt;
    `stop()` logs what is left. It reads nothing of this machine: the supervisor's cost per node is one
    dict of numbers per sample."""

    def __init__(self, run_id: str, take: TakeSamples, interval_s: float = DEFAULT_INTERVAL_S, *,
                 tracking_uri: str | None = None, warn: Warn | None = None,
                 first: Mapping[int, NodeSamples] | None = None) -> None:
        super().__init__(run_id, tracking_uri, warn, interval_s, "air-node-sysmetrics")
        self.take = take
        self.steps: dict[int, int] = {}  # node -> samples logged
        self.nodes: set[int] = set()
        self._pending: dict[int, NodeSamples] = {}
        self._problems: set[str] = set()
        if first:
            self._add(first)

    @property
    def what(self) -> str:
        seen = self.nodes | set(self._pending)
        return nodes_named(sorted(seen)) if seen else "the nodes"

    def _add(self, arrived: Mapping[int, NodeSamples]) -> None:
        for node, got in arrived.items():
            pending = self._pending.get(node)
            if pending is None:
                self._pending[node] = NodeSamples(dict(got.labels), list(got.samples), got.problem)
            else:
                pending.samples.extend(got.samples)
                pending.labels.update(got.labels)
                pending.problem = got.problem or pending.problem

    def tick(self) -> bool:
        """Log what arrived since the last batch (`stop()`: once more, then the thread ends)."""
        try:
            self._add(self.take() or {})
        except Exception as exc:  # tracking never fails a run
            self.warn(f"tracking: system metrics of {self.what} stopped: {short_message(exc)}")
            return False
        self._flush()
        return not self._failed

    def _flush(self) -> None:
        """Log every pending sample of every node as one batch (chunked at MLflow's limit)."""
        from mlflow.entities import Metric, RunTag

        pending, self._pending = self._pending, {}
        batch: list[Metric] = []
        tags: list[RunTag] = []
        for node, got in sorted(pending.items()):
            self._warn_problem(node, got.problem)
            if not got.samples:
                if node not in self.nodes:  # labels wait for the node's first sample
                    self._pending[node] = got
                continue
            if node not in self.nodes:
                self.nodes.add(node)
                tags += [RunTag(f"air.{key}.node_{node}", value) for key, value in got.labels.items() if value]
            step = self.steps.get(node, 0)
            for ts_ms, values in got.samples:
                batch += [Metric(f"system/node_{node}/{k}", v, ts_ms, step) for k, v in values.items()]
                step += 1
            self.steps[node] = step
        if batch or tags:
            self._send(batch, tags)

    def _warn_problem(self, node: int, problem: str) -> None:
        """A node's problem, once per attempt (the same words from other nodes are not repeated)."""
        if problem and problem not in self._problems:
            self._problems.add(problem)
            self.warn(f"{problem} (node {node}; other nodes saying the same are not named)")


def _default_uri() -> str:
    """The node's tracking URI: the one air exported, else air's default."""
    return tracking_uri()

