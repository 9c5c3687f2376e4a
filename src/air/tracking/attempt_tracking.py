"""MLflow for one attempt of any run (a workload attempt or a `remote=True` call), while it runs.

The run controller holds one `AttemptTracking` per attempt: made before the nodes start (its `env()`
goes to every process), per-node system metrics while they run, the node and rank logs as artifacts
and the MLflow run's status at the end. It never decides whether training runs: every failure is a
warning line (in the node logs, or on the caller's stderr).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from air.tracking.handle import TrackingHandle
from air.tracking.store import tracking_enabled


class AttemptTracking:
    """The MLflow run of one attempt (None handle: tracking is off or failed; every method is a no-op)."""

    def __init__(self, handle: TrackingHandle | None, attempt: int, warn: Callable[[str], None]) -> None:
        self.handle = handle
        self.attempt = attempt
        self.warn = warn
        self.samplers: list[Any] = []

    @classmethod
    def off(cls, attempt: int = 0) -> AttemptTracking:
        return cls(None, attempt, lambda _line: None)

    @classmethod
    def for_workload(cls, *, experiment: str, run_name: str | None, tags: Mapping[str, str],
                     params: Mapping[str, Any], attempt: int, warn: Callable[[str], None]) -> AttemptTracking:
        """A workload attempt: one MLflow run in the workload's experiment, with its parameters."""
        if not tracking_enabled():
            return cls(None, attempt, warn)
        try:
            from air.tracking.attempt import start_attempt_run

            handle = start_attempt_run(experiment, run_name, tags=tags, params=params, warn=warn)
        except Exception as exc:  # tracking must never fail a run
            warn(f"tracking: off for this attempt: {exc}")
            handle = None
        return cls(handle, attempt, warn)

    @classmethod
    def for_call(cls, *, func_name: str, tags: Mapping[str, str], attempt: int,
                 warn: Callable[[str], None]) -> AttemptTracking:
        """A call's attempt: one MLflow run where the caller's MLflow puts it (see air.tracking.call)."""
        if not tracking_enabled():
            return cls(None, attempt, warn)
        try:
            from air.tracking.call import start_call_run

            handle = start_call_run(func_name, tags=tags, warn=warn)
        except Exception as exc:
            warn(f"tracking: {type(exc).__name__}: {exc}")
            handle = None
        return cls(handle, attempt, warn)

    def env(self) -> dict[str, str]:
        return dict(self.handle.env()) if self.handle is not None else {}

    def start_samplers(self, gpus_per_node: Sequence[Sequence[str]] | None, num_nodes: int) -> None:
        """System metrics per node (this machine's CPU and memory; the node's own GPUs, None for CPU runs)."""
        if self.handle is None:
            return
        try:
            from air.tracking.sysmetrics import SystemMetricsSampler

            for node in range(num_nodes):
                gpus = None
                if gpus_per_node is not None:
                    gpus = [int(g) for g in gpus_per_node[node] if str(g).isdigit()]
                sampler = SystemMetricsSampler(self.handle.run_id, node, tracking_uri=self.handle.tracking_uri,
                                               gpu_indices=gpus, warn=self.warn)
                sampler.start()
                self.samplers.append(sampler)
        except Exception as exc:
            self.warn(f"tracking: no system metrics: {exc}")

    def end(self, status: str, reason: str | None = None, *, node_logs: Mapping[int, Path] | None = None,
            rank_logs: Mapping[int, Path] | None = None) -> None:
        """Stop the samplers, attach the logs, set the MLflow run's status (FINISHED, FAILED, KILLED)."""
        for sampler in self.samplers:
            try:
                sampler.stop()
            except Exception:
                pass
        self.samplers = []
        handle, self.handle = self.handle, None
        if handle is None:
            return
        try:
            for node, path in (node_logs or {}).items():
                handle.log_node_log(path, self.attempt, node)
            for rank, path in (rank_logs or {}).items():
                if path.is_file():
                    handle.log_rank_log(path, rank)
            handle.end(status, reason)
        except Exception as exc:  # tracking never fails a run
            self.warn(f"tracking: {type(exc).__name__}: {exc}")
