"""MLflow for one attempt of any run (a workload attempt or a `remote=True` call), while it runs.

The run controller holds one `AttemptTracking` per attempt: made before the nodes start (its `env()`
goes to every process), system metrics of the nodes while they run, the node and rank logs as artifacts
and the MLflow run's status at the end. It never decides whether training runs: every failure is a
warning line (supervisor.log, or the caller's stderr).

A workload attempt's MLflow run is made off the start path (`WorkloadTracking`): in a background thread
while the nodes already run, handed to them through node_hook.py when it exists.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

from air.tracking.handle import TrackingHandle
from air.tracking.store import tracking_enabled, tracking_uri

#: MLflow's switch that makes `mlflow.log_metric` & co. queue and return at once.
ASYNC_LOGGING = "MLFLOW_ENABLE_ASYNC_LOGGING"

#: The nodes' MLflow HTTP retries (MLflow's defaults, but 10 tries, MLflow's maximum, instead of 7: backoff
#: doubles from 2 s up to urllib3's 120 s cap, so a queued metric is retried for ~10 minutes, not ~4: an
#: air server restart, its MLflow's start included, takes minutes on a loaded machine).
NODE_HTTP_RETRIES = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "10",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "1.0",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "120",
}

#: Node and rank logs uploaded at once at the end of an attempt (a 32-node attempt: 4 rounds, not 32).
UPLOAD_WORKERS = 8


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
                     params: Mapping[str, Any], attempt: int, warn: Callable[[str], None],
                     files: tuple[Path, Path] | None = None, before: Callable[[], object] | None = None,
                     wait: bool = False) -> AttemptTracking:
        """A workload attempt: one MLflow run in the workload's experiment, with its parameters.

        With `files` (the attempt's run-variables file and hook folder) the run is made in the background
        (WorkloadTracking), after `before` (e.g. waiting for a server's MLflow); without, here and now."""
        if not tracking_enabled():
            return cls(None, attempt, warn)

        def create() -> TrackingHandle | None:
            from air.tracking.attempt import start_attempt_run

            if before is not None:
                before()
            return start_attempt_run(experiment, run_name, tags=tags, params=params, warn=warn)

        if files is not None:
            return WorkloadTracking(create, attempt=attempt, env_file=files[0], hook_dir=files[1], warn=warn,
                                    wait=wait)
        try:
            handle = create()
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

    def when_ready(self, callback: Callable[[], None]) -> None:
        """Call `callback` once the MLflow run exists or is known not to (here: at once)."""
        callback()

    def start_samplers(self, gpus_per_node: Sequence[Sequence[str]] | None, num_nodes: int) -> None:
        """System metrics of the nodes on this machine (its CPU and memory; each node's own GPUs, None
        for CPU runs): one sampler thread and one MLflow batch per interval for all of them."""
        if self.handle is None:
            return
        try:
            from air.tracking.sysmetrics import SystemMetricsSampler

            nodes: dict[int, list[int] | None] = {}
            for node in range(num_nodes):
                nodes[node] = None
                if gpus_per_node is not None:
                    nodes[node] = [int(g) for g in gpus_per_node[node] if str(g).isdigit()]
            sampler = SystemMetricsSampler(self.handle.run_id, 0, tracking_uri=self.handle.tracking_uri,
                                           nodes=nodes, warn=self.warn)
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
            upload_logs(handle, self.attempt, node_logs or {}, rank_logs or {})
            handle.end(status, reason)
        except Exception as exc:  # tracking never fails a run
            self.warn(f"tracking: {type(exc).__name__}: {exc}")


def upload_logs(handle: TrackingHandle, attempt: int, node_logs: Mapping[int, Path],
                rank_logs: Mapping[int, Path]) -> None:
    """Node logs (`logs/attempt_<a>/node_<n>.log`) and rank logs (`logs/rank_<r>.log`) as artifacts, in
    parallel: the end of a 32-node attempt waits for a few uploads' time, not 32 in a row."""
    jobs: list[Callable[[], bool]] = [partial(handle.log_node_log, path, attempt, node)
                                      for node, path in node_logs.items()]
    jobs += [partial(handle.log_rank_log, path, rank) for rank, path in rank_logs.items() if path.is_file()]
    if len(jobs) <= 1:
        for job in jobs:
            job()
        return
    with ThreadPoolExecutor(max_workers=min(UPLOAD_WORKERS, len(jobs)), thread_name_prefix="air-log-upload") as pool:
        for future in [pool.submit(job) for job in jobs]:
            future.result()


class WorkloadTracking(AttemptTracking):
    """A workload attempt's MLflow run, made in a background thread while the nodes start and run.

    `env()` is ready at once: the tracking URI and the node hook (node_hook.py) on PYTHONPATH, which hands
    each node process the run's id from `env_file` once this thread wrote it. `end()` waits for the run
    (bounded), then ends it as usual. `wait=True` (nodes that cannot read the attempt's folder, e.g. walled
    in by a sandbox) makes `env()` wait for the run and carry MLFLOW_RUN_ID itself, as before.
    """

    #: How long `end()` and a waiting `env()` wait for the run to exist.
    CREATE_WAIT_S = 300.0

    def __init__(self, create: Callable[[], TrackingHandle | None], *, attempt: int, env_file: Path,
                 hook_dir: Path, warn: Callable[[str], None], wait: bool = False) -> None:
        super().__init__(None, attempt, warn)
        self.env_file = env_file
        self.hook_dir = hook_dir
        self.wait = wait
        self._create = create
        self._uri = tracking_uri()
        #: The user's own MLflow HTTP settings, read before any thread of air's shortens them.
        self._user_http = {k: os.environ[k] for k in NODE_HTTP_RETRIES if k in os.environ}
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []
        self._ended = False
        self._thread = threading.Thread(target=self._run, name="air-mlflow-attempt", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from air.tracking.node_hook import write_env

        handle: TrackingHandle | None = None
        try:
            handle = self._create()
        except Exception as exc:  # tracking must never fail a run
            self.warn(f"tracking: off for this attempt: {exc}")
        with self._lock:
            if not self._ended:
                self.handle = handle
        try:
            write_env(self.env_file, {k: v for k, v in handle.env().items() if k != "MLFLOW_TRACKING_URI"}
                      if handle is not None else {})
        except OSError as exc:
            self.warn(f"tracking: the nodes cannot learn their MLflow run: {exc}")
        while callbacks := self._take_callbacks():  # ready only once every callback ran (end() waits for it)
            for callback in callbacks:
                self._safely(callback)

    def _take_callbacks(self) -> list[Callable[[], None]]:
        with self._lock:
            callbacks, self._callbacks = self._callbacks, []
            if not callbacks:
                self._ready.set()
        return callbacks

    def _safely(self, callback: Callable[[], None]) -> None:
        try:
            callback()
        except Exception as exc:  # tracking never fails a run
            self.warn(f"tracking: {type(exc).__name__}: {exc}")

    def when_ready(self, callback: Callable[[], None]) -> None:
        """`callback` runs in the creating thread once the run exists (at once if it already does)."""
        with self._lock:
            if not self._ready.is_set():
                self._callbacks.append(callback)
                return
        self._safely(callback)

    def env(self) -> dict[str, str]:
        if self.wait:
            self._ready.wait(self.CREATE_WAIT_S)
            if self.handle is None:
                return {}
            env = dict(self.handle.env())
        else:
            from air.tracking.node_hook import write_hook

            try:
                hook = write_hook(self.hook_dir, self.env_file)
            except OSError as exc:
                self.warn(f"tracking: the nodes cannot learn their MLflow run: {exc}")
                return {"MLFLOW_TRACKING_URI": self._uri}
            env = {"MLFLOW_TRACKING_URI": self._uri, "PYTHONPATH": str(hook)}
        return env

    def start_samplers(self, gpus_per_node: Sequence[Sequence[str]] | None, num_nodes: int) -> None:
        """Sampling starts when the run exists (nothing is logged before it does)."""
        self.when_ready(lambda: AttemptTracking.start_samplers(self, gpus_per_node, num_nodes))

    def end(self, status: str, reason: str | None = None, *, node_logs: Mapping[int, Path] | None = None,
            rank_logs: Mapping[int, Path] | None = None) -> None:
        if not self._ready.wait(self.CREATE_WAIT_S):
            self.warn(f"tracking: the attempt's MLflow run was not made within {self.CREATE_WAIT_S:g} s; "
                      "it is not ended")
            with self._lock:
                self._ended = True
            return
        super().end(status, reason, node_logs=node_logs, rank_logs=rank_logs)


def node_hook_env(env: dict[str, str], tracking_env: Mapping[str, str]) -> dict[str, str]:
    """A node's environment with the tracking hook first on PYTHONPATH (after the node's own variables
    were set, so a PYTHONPATH of the workload's keeps its entries behind it)."""
    hook = tracking_env.get("PYTHONPATH")
    if not hook:
        return env
    from air.tracking.node_hook import prepend_pythonpath

    return prepend_pythonpath(env, hook)


__all__ = ["AttemptTracking", "WorkloadTracking", "node_hook_env", "upload_logs"]
