"""MLflow for one attempt of any run (a workload attempt or a `remote=True` call), while it runs.

The run controller holds one `AttemptTracking` per attempt: made before the nodes start (its `env()`
goes to every process), system metrics of the nodes while they run, the node and rank logs as artifacts
and the MLflow run's status at the end. It never decides whether training runs: every failure is a
warning line (supervisor.log, or the caller's stderr).

A workload attempt's MLflow run is made off the start path (`WorkloadTracking`): in a background thread
while the nodes already run, handed to them through node_hook.py when it exists. The controller joins
that thread (`wait_ready`) before it records a retried attempt's end (RETRY names its run); the last
attempt's end and the run's end state are written at once, and `end()`, called after them in the same
supervisor, waits for the run (its id is then recorded by the `when_ready` callback) and ends it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from air.tracking.handle import TrackingHandle
from air.tracking.store import is_http, tracking_enabled, tracking_uri

if TYPE_CHECKING:
    from air.tracking.sysmetrics import NodeMetricsLogger, SystemMetricsSampler, TakeSamples

#: The nodes' MLflow HTTP retries (MLflow's defaults, but 10 tries, MLflow's maximum, instead of 7: backoff
#: doubles from 2 s up to urllib3's 120 s cap, so a queued metric is retried for ~10 minutes, not ~4: an
#: air server restart, its MLflow's start included, takes minutes on a loaded machine). The door's 503
#: while MLflow starts carries a Retry-After, which urllib3 sleeps *instead of* the backoff: honoured, ten
#: retries were spent in ten Retry-Afters (~50 s) and queued batches dropped; nodes back off the same way
#: whether the server is down (refused) or starting (503).
NODE_HTTP_RETRIES = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "10",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "1.0",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "120",
    "MLFLOW_HTTP_RESPECT_RETRY_AFTER_HEADER": "false",
}

#: MLflow's usage telemetry off in the nodes, as Ray's usage stats are (air.backends.ray_cluster), unless the
#: user said otherwise (either variable set). Besides sending usage data from a self-hosted machine, on one
#: that cannot reach MLflow's endpoint its config thread gives up by popping `_MLFLOW_TELEMETRY_SESSION_ID`
#: from `os.environ` while the async logging thread (http(s) tracking) copies `os.environ` for a request: the
#: batch failed with KeyError and a node's metric was lost (MLflow 3).
NODE_TELEMETRY = {"MLFLOW_DISABLE_TELEMETRY": "true"}
TELEMETRY_SETTINGS = ("MLFLOW_DISABLE_TELEMETRY", "DO_NOT_TRACK")


def node_telemetry() -> dict[str, str]:
    """NODE_TELEMETRY for a tracked attempt's nodes and ranks (runs.listeners.tracking), unless this process's
    user set either of TELEMETRY_SETTINGS (the nodes then inherit their choice)."""
    return {} if any(k in os.environ for k in TELEMETRY_SETTINGS) else dict(NODE_TELEMETRY)

#: How long nodes that need the attempt's MLflow run id first (Ray's, Slurm's) wait for it before it is said.
WAIT_TOLD_AFTER_S = 2.0

#: Per-request limit of the calls that make an attempt's MLflow run through an http(s) server (air's own
#: calls otherwise give up after 5 s: a loaded server's MLflow answered later, and the attempt ran untracked).
CREATE_HTTP_TIMEOUT_S = 60

#: Node and rank logs uploaded at once at the end of an attempt (a 32-node attempt: 4 rounds, not 32).
UPLOAD_WORKERS = 8


class AttemptTracking:
    """The MLflow run of one attempt (None handle: tracking is off or failed; every method is a no-op)."""

    def __init__(self, handle: TrackingHandle | None, attempt: int, warn: Callable[[str], None]) -> None:
        self.handle = handle
        self.attempt = attempt
        self.warn = warn
        self.samplers: list[SystemMetricsSampler | NodeMetricsLogger] = []

    @classmethod
    def off(cls, attempt: int = 0) -> AttemptTracking:
        return cls(None, attempt, lambda _line: None)

    @classmethod
    def for_workload(cls, *, experiment: str, run_name: str | None, tags: Mapping[str, str],
                     params: Mapping[str, object], attempt: int, warn: Callable[[str], None],
                     files: tuple[Path, Path] | None = None, before: Callable[[], object] | None = None,
                     wait: bool = False, walled: bool = False) -> AttemptTracking:
        """A workload attempt: one MLflow run in the workload's experiment, with its parameters.

        With `files` (the attempt's run-variables file and hook folder) the run is made in the background
        (WorkloadTracking), after `before` (e.g. waiting for a server's MLflow); without, here and now.
        `walled`: the nodes run in a sandbox that shows them only the hook's folder (see WorkloadTracking)."""
        if not tracking_enabled():
            return cls(None, attempt, warn)

        once = _WarnOnce(warn)  # retried in the background (WorkloadTracking): one line per attempt

        def create() -> TrackingHandle | None:
            from air.tracking.attempt import start_attempt_run

            if before is not None:
                before()
            return start_attempt_run(experiment, run_name, tags=tags, params=params, warn=once,
                                     timeout_s=CREATE_HTTP_TIMEOUT_S)

        if files is not None:
            return WorkloadTracking(create, attempt=attempt, env_file=files[0], hook_dir=files[1], warn=warn,
                                    wait=wait, walled=walled)
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

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        """Wait until the run exists (or is known not to) and every `when_ready` callback ran, so the
        attempt's end is recorded after its MLflow run id (readers of an ended attempt see it). Here: at once."""
        return True

    def start_samplers(self, gpus_per_node: Sequence[Sequence[str]] | None, num_nodes: int,
                       take_samples: TakeSamples | None = None) -> None:
        """System metrics of the nodes: one thread and one MLflow batch per interval for all of them. Nodes
        that sample their own hosts (`take_samples()` is not None: a Ray attempt's agents) have what they
        sampled logged; else this machine is sampled for its nodes (its CPU and memory; each node's own
        GPUs, None for CPU runs)."""
        if self.handle is None:
            return
        try:
            from air.tracking.sysmetrics import NodeMetricsLogger, SystemMetricsSampler

            first = take_samples() if take_samples is not None else None
            if take_samples is not None and first is not None:
                logger = NodeMetricsLogger(self.handle.run_id, take_samples, tracking_uri=self.handle.tracking_uri,
                                           warn=self.warn, first=first)
                logger.start()
                self.samplers.append(logger)
                return
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
    (bounded), then ends it as usual. `walled=True` (nodes in a sandbox, which see only the hook's folder,
    bound read-only) writes the run's variables into the hook's folder too (node_hook.node_env_of), and its
    hook keeps no spool (nothing a walled node writes is read here) and waits as long as `env()` once did
    (CREATE_WAIT_S): walled nodes start at once too, and only a process's `import mlflow` waits for the run.
    `wait=True` (nodes that cannot read even that, e.g. on another machine) makes `env()` wait for the run
    and carry MLFLOW_RUN_ID itself.
    """

    #: How long `end()` and a waiting `env()` wait for the run to exist.
    CREATE_WAIT_S = 300.0
    #: How long an ended attempt's `end()` still waits for its run to be made through a server that is away,
    #: in the living supervisor, before it gives up (with CREATE_WAIT_S before it, within the controller's
    #: TRACKING_END_S of 600 s, uploads after).
    LATE_WAIT_S = 240.0
    #: Longest pause between two tries to make the run.
    RETRY_PAUSE_MAX_S = 15.0

    #: Told what the nodes wait for while `env()` waits past WAIT_TOLD_AFTER_S, then None (the run's state).
    on_waiting: Callable[[str | None], None] | None = None

    def __init__(self, create: Callable[[], TrackingHandle | None], *, attempt: int, env_file: Path,
                 hook_dir: Path, warn: Callable[[str], None], wait: bool = False, walled: bool = False) -> None:
        super().__init__(None, attempt, warn)
        self.env_file = env_file
        self.hook_dir = hook_dir
        self.wait = wait
        self.walled = walled
        self._create = create
        self._uri = tracking_uri()
        #: The user's own MLflow HTTP settings, read before any thread of air's shortens them.
        self._user_http = {k: os.environ[k] for k in NODE_HTTP_RETRIES if k in os.environ}
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []
        self._ended = False
        self._ending = False
        self._retrying = False
        self._give_up = threading.Event()
        self._late_warned = False
        self._thread = threading.Thread(target=self._run, name="air-mlflow-attempt", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        handle = self._make()
        with self._lock:
            late = self._ended
            if not late:
                self.handle = handle
        if late and handle is not None:  # end() stopped waiting while this call was in flight
            handle.end("FAILED", "made after the attempt's end had stopped waiting for it")
        try:
            self._write_env({k: v for k, v in handle.env().items() if k != "MLFLOW_TRACKING_URI"}
                            if handle is not None else {})
        except OSError as exc:
            self.warn(f"tracking: the nodes cannot learn their MLflow run: {exc}")
        while callbacks := self._take_callbacks():  # ready only once every callback ran (end() waits for it)
            for callback in callbacks:
                self._safely(callback)

    def _write_env(self, values: Mapping[str, str]) -> None:
        """The run's variables for the nodes' hooks (`{}`: no run), and the walled nodes' copy."""
        from air.tracking.node_hook import node_env_of, write_env

        write_env(self.env_file, values)
        if self.walled:
            write_env(node_env_of(self.hook_dir), values)

    def _make(self) -> TrackingHandle | None:
        """The attempt's run; through an http(s) server, tried again (backoff up to `RETRY_PAUSE_MAX_S`) until
        it is made or `end()` gives up: a server that is away or slow (restarting, loaded) must not leave the
        attempt untracked. Nodes' `import mlflow` keeps waiting for it meanwhile (node_hook.HOOK_WAIT_S)."""
        pause = 2.0
        while True:
            try:
                handle = self._create()
            except Exception as exc:  # tracking must never fail a run
                self.warn(f"tracking: off for this attempt: {exc}")
                handle = None
            if handle is not None or not is_http(self._uri):
                return handle
            if not self._retrying:
                self._retrying = True
                self.warn("tracking: the attempt's MLflow run is tried again in the background until the "
                          "tracking server answers (made afterwards if the attempt ends first)")
            if self._give_up.wait(pause):
                return None
            pause = min(2 * pause, self.RETRY_PAUSE_MAX_S)

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
            if not self._ready.wait(WAIT_TOLD_AFTER_S):  # said (supervisor.log, `--watch -v`), not silent
                self.warn(f"tracking: waiting for the attempt's MLflow run ({tracking_uri()}) before the nodes start: "
                    f"they get its MLFLOW_RUN_ID (at most {self.CREATE_WAIT_S:g} s)")
                if self.on_waiting is not None:  # and shown as the run's state (air list runs, --watch, pages)
                    self.on_waiting(f"its MLflow run ({tracking_uri()}) before the nodes start")
                try:
                    self._ready.wait(self.CREATE_WAIT_S)
                finally:
                    if self.on_waiting is not None:
                        self.on_waiting(None)
            if self.handle is None:
                return {}
            env = dict(self.handle.env())
            if is_http(self._uri):  # the hook only for its exit flush of MLflow's queue (node_hook.py)
                env |= _hook_env(self.hook_dir, self.env_file, self.warn,
                                 "the nodes' MLflow logging blocks while the server is away", walled=self.walled)
        else:
            env = {"MLFLOW_TRACKING_URI": self._uri,
                   **_hook_env(self.hook_dir, self.env_file, self.warn, "the nodes cannot learn their MLflow run",
                               walled=self.walled, wait_s=self.CREATE_WAIT_S if self.walled else None)}
            if "PYTHONPATH" not in env:
                return env
        if is_http(self._uri):
            # A tracking server that is away (restarting) must not block training: the hook turns on MLflow's
            # async logging and flushes its queue at exit; queued metrics are retried until the server is back.
            # The retry variables are given explicitly: air's own short limits (store.http_limits) may be in
            # this process's environment right now (the creating thread), and must not reach the nodes.
            env |= {**NODE_HTTP_RETRIES, **self._user_http}
        return env

    def start_samplers(self, gpus_per_node: Sequence[Sequence[str]] | None, num_nodes: int,
                       take_samples: TakeSamples | None = None) -> None:
        """Sampling starts when the run exists (nothing is logged before it does). Nodes that sample their
        own hosts keep their samples until then: logged even if the attempt ended first."""
        self.when_ready(lambda: None if self._ending and take_samples is None
                        else AttemptTracking.start_samplers(self, gpus_per_node, num_nodes, take_samples))

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        """Join the creating thread (bounded: `CREATE_WAIT_S` by default); False (one warning) if it is
        still at work, e.g. a tracking server that does not answer. Once it was late, it is not waited for again."""
        if timeout_s is None:
            timeout_s = 0.0 if self._late_warned else self.CREATE_WAIT_S
        if self._ready.wait(timeout_s):
            return True
        with self._lock:
            warned, self._late_warned = self._late_warned, True
        if not warned:
            self.warn(f"tracking: the attempt's MLflow run was not made within {timeout_s:g} s; the attempt "
                      "ends without it")
        return False

    def end(self, status: str, reason: str | None = None, *, node_logs: Mapping[int, Path] | None = None,
            rank_logs: Mapping[int, Path] | None = None) -> None:
        self._ending = True
        late_s = _shortened(self.LATE_WAIT_S)
        if (not self.wait_ready(_shortened(0.0 if self._late_warned else self.CREATE_WAIT_S))
                and not self._ready.wait(late_s)):
            # The supervisor lives on for this: the run is made (its logs and status below) as soon as the
            # server answers; only after LATE_WAIT_S more it gives up. The controller then marks the run
            # "tracking pending" (air.runs.reconcile): `air server` makes the run once its MLflow is back.
            with self._lock:
                self._ended = True
            self._give_up.set()
            self.warn(f"tracking: the attempt's MLflow run could not be made within {late_s:g} s "
                      "after its end; given up (made afterwards by `air server` once its MLflow answers)")
            try:
                self._write_env({})  # (hooks still waiting go on without it: node_hook.py)
            except OSError:
                pass
            return
        if self.handle is not None and not self.walled:  # (walled nodes have no spool: nothing of theirs is read)
            from air.tracking.backfill import copy_spool
            from air.tracking.node_hook import spool_of

            copy_spool(spool_of(self.hook_dir), self.handle, self.warn)
            if self._retrying:
                self.handle.set_tags({"air.backfilled": "true"})
        super().end(status, reason, node_logs=node_logs, rank_logs=rank_logs)


def _shortened(seconds: float) -> float:
    """`seconds`, or less under the tests' AIR_TRACKING_GIVE_UP_S (it never lengthens a wait)."""
    from air.settings import AIR_TRACKING_GIVE_UP_S

    try:
        return min(seconds, max(0.0, float(os.environ.get(AIR_TRACKING_GIVE_UP_S) or seconds)))
    except ValueError:
        return seconds


class _WarnOnce:
    """`warn`, but each distinct line once (a run made again and again writes its failure once)."""

    def __init__(self, warn: Callable[[str], None]) -> None:
        self.warn = warn
        self.said: set[str] = set()

    def __call__(self, line: str) -> None:
        key = line.split(":", 2)[:2]
        if str(key) not in self.said:
            self.said.add(str(key))
            self.warn(line)


def _hook_env(hook_dir: Path, env_file: Path, warn: Callable[[str], None], without: str, *, walled: bool = False,
              wait_s: float | None = None) -> dict[str, str]:
    """The nodes' PYTHONPATH with the hook written (node_hook.py; `walled`: for nodes in a sandbox, and
    `wait_s`: its wait for the run, HOOK_WAIT_S by default); {} and a warning (`without`: what the nodes
    then lack) if it cannot be written."""
    from air.tracking.node_hook import HOOK_WAIT_S, write_hook

    wait = HOOK_WAIT_S if wait_s is None else wait_s
    try:
        return {"PYTHONPATH": str(write_hook(hook_dir, env_file, wait_s=_shortened(wait), walled=walled))}
    except OSError as exc:
        warn(f"tracking: {without}: {exc}")
        return {}


def node_hook_env(env: dict[str, str], tracking_env: Mapping[str, str]) -> dict[str, str]:
    """A node's environment with the tracking hook first on PYTHONPATH (after the node's own variables
    were set, so a PYTHONPATH of the workload's keeps its entries behind it)."""
    hook = tracking_env.get("PYTHONPATH")
    if not hook:
        return env
    from air.tracking.node_hook import prepend_pythonpath

    return prepend_pythonpath(env, hook)


def node_command(command: str, command_path: str, tracking_env: Mapping[str, str]) -> list[str]:
    """A node's argv: `bash -euo pipefail COMMAND_FILE`. A command that reads MLFLOW_RUN_ID itself, started
    before its run exists (early start), runs through the hook's bash prelude (node_hook.prelude_of): it waits
    for the run, exports its id, then runs the same. Other commands start at once (their Python processes
    get the id from the hook, when they read it or import mlflow)."""
    argv = ["bash", "-euo", "pipefail", command_path]
    hook = tracking_env.get("PYTHONPATH")
    if not hook or tracking_env.get("MLFLOW_RUN_ID"):
        return argv
    from air.tracking.node_hook import prelude_of, reads_run_id

    prelude = prelude_of(Path(hook))
    if not reads_run_id(command) or not prelude.is_file():
        return argv
    return ["bash", str(prelude), command_path]

