"""`@distributed(remote=True)`: the call becomes a run on the profile's backend, and this process waits.

The run is recorded in the run store (kind `call`, so `air list runs` and `air logs` show it);
its nodes are placed by the backend (Ray: one gang-scheduled placement group); on each node the agent
starts LOCAL_WORLD_SIZE rank processes (`python -m air.distributed.worker`) with the same
environment as a local call, global rank = node_rank * per_node + local_rank. The payload goes to each
node, outcomes come back, and `resolve` turns them into the per-rank list or the rank's exception,
exactly as in local mode. Lines stream here prefixed `[node n rank r]`; Ctrl-C (or `air cancel`)
ends every rank on every node and records the run CANCELED.

Before any rank starts, the nodes' Python, cloudpickle and torch versions are compared with this
process's: a pickled call only loads where they match.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from air.accelerators import AcceleratorType, normalize_model, parse_accelerator_type
from air.distributed.local import rank_env, serialize_call, warm_enabled
from air.distributed.outcome import read_outcome, resolve
from air.distributed.preload import RANK_PRELOAD_ENV, preload_for
from air.distributed.shape import CallSettings
from air.errors import (
    BackendUnavailableError,
    GPUValidationError,
    RuntimeConfigurationError,
    WorkloadFailureException,
)
from air.launcher.node import LaunchResult, ProcessExit
from air.runs.paths import CallPaths

#: How often the waiting caller looks at the run store for an `air cancel`.
CANCEL_CHECK_S = 1.0

_CONFIG_HINT = (
    "Add a Ray profile to $AIR_HOME/config.yaml (default ~/.air/config.yaml) and choose it:\n"
    "  default_profile: cluster\n"
    "  profiles:\n"
    "    cluster: {backend: ray, address: \"HEAD_HOST:6379\"}\n"
    "(or set AIR_PROFILE=cluster). Use remote=False to run on this machine's accelerators."
)


def run_remote(func: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any],
               settings: CallSettings, *, profile_name: str | None = None, echo: bool = True,
               extra_env: Mapping[str, str] | None = None) -> list[Any]:
    """Run `func(*args, **kwargs)` once per rank on the profile's backend; block; return every rank's value."""
    from air.config import resolve_profile

    profile = resolve_profile(profile_name)
    if profile.backend != "ray":
        raise BackendUnavailableError(
            f"remote=True needs a remote backend, and the profile {profile.name!r} is {profile.backend!r} "
            "(no remote backend configured).",
            hint=_CONFIG_HINT,
        )
    from air.backends.ray_backend import RayBackend

    backend = RayBackend.from_profile(profile)
    backend.connect()
    accelerator, num_nodes = plan_shape(backend, settings)
    backend.check_shape(accelerator, num_nodes)
    payload = serialize_call(func, args, kwargs)
    name = getattr(func, "__name__", "fn")
    record = RemoteRunRecord.create(name=name, accelerator=accelerator, num_nodes=num_nodes,
                                    num_accelerators=accelerator.per_node * num_nodes, profile=profile.name)
    return _RemoteCall(backend, record, accelerator, num_nodes, payload, name, settings.timeout, echo,
                       dict(extra_env or {}), preload_for(func, args, kwargs)).run()


# ---- shape ---------------------------------------------------------------------------------------


def plan_shape(backend: Any, settings: CallSettings) -> tuple[AcceleratorType, int]:
    """Node shape and node count for a remote call.

    A full type (`GPU_8xH100`, `CPU_2xCPU`) fixes the ranks per node. A bare model (`H100`, `CPU`, `GPU`)
    packs as many ranks per node as the cluster's nodes hold, using as few nodes as possible.
    """
    count = settings.num_accelerators
    raw = (settings.accelerator_type or "").strip()
    if count is None or not raw:
        missing = " and ".join(n for n, v in (("num_accelerators", count), ("accelerator_type", raw)) if not v)
        raise RuntimeConfigurationError(
            f"remote=True needs {missing}: how many ranks, on which accelerator.",
            hint="For example @distributed(num_accelerators=16, accelerator_type='GPU_8xH100', remote=True), "
            "or accelerator_type='CPU' to run CPU ranks on the cluster.",
        )
    if "_" in raw:
        kind, _, rest = raw.partition("_")
        per_node, _, model = rest.lower().partition("x")
        canonical = "CPU" if kind.upper() == "CPU" else (normalize_model(model) or model.upper())
        accelerator = parse_accelerator_type(f"{kind.upper()}_{per_node}x{canonical}")
        return accelerator, accelerator.nodes_for(count)
    nodes = backend._alive_nodes()
    if raw.lower() == "cpu":
        model = "CPU"
        capacities = [int(n["Resources"].get("CPU", 0)) for n in nodes]
    else:
        wanted = None if raw.lower() == "gpu" else (normalize_model(raw) or raw.upper())
        capacities = []
        model = wanted or ""
        for node in nodes:
            types = [k.split(":", 1)[1] for k in node["Resources"] if k.startswith("accelerator_type:")]
            names = {normalize_model(t) or t for t in types}
            if wanted is None and names:
                model = model or sorted(names)[0]
            if (wanted is None and model in names) or (wanted is not None and wanted in names):
                capacities.append(int(node["Resources"].get("GPU", 0)))
        if not model:
            raise GPUValidationError(f"Asked for GPUs, but {backend.describe_capacity()}.",
                                     hint="Pass accelerator_type='CPU' to run CPU ranks.")
    for per_node in range(min(count, max(capacities, default=0)), 0, -1):
        if count % per_node == 0 and sum(1 for c in capacities if c >= per_node) >= count // per_node:
            kind = "CPU" if model == "CPU" else "GPU"
            return AcceleratorType(kind, per_node, model), count // per_node
    raise GPUValidationError(
        f"{count} × {raw} ranks do not fit on the cluster: {backend.describe_capacity()}.",
        hint="Ask for fewer, or give a node shape such as GPU_8xH100 / CPU_2xCPU explicitly.",
    )


# ---- the run record ------------------------------------------------------------------------------


class RemoteRunRecord:
    """The run-store side of a remote call, in one place (so wiring changes touch only this class).

    Every method is best effort after `create`: a store problem must not lose the user's results.
    """

    def __init__(self, store: Any, run_id: str) -> None:
        self.store = store
        self.run_id = run_id
        self.attempt: int | None = None

    @classmethod
    def create(cls, *, name: str, accelerator: AcceleratorType, num_nodes: int, num_accelerators: int,
               profile: str) -> RemoteRunRecord:
        from air.runs.states import RunStatus
        from air.runs.store import RunStore

        store = RunStore()
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "air-distributed"
        run = store.create_run(experiment=experiment, accelerator_type=accelerator.name,
                               num_accelerators=num_accelerators, num_nodes=num_nodes, backend="ray",
                               profile=profile, kind="call", run_name=name).run
        record = cls(store, run.id)
        record._safe(store.set_supervisor, run.id, os.getpid())
        record._safe(store.transition, run.id, RunStatus.QUEUED)
        return record

    def _safe(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001
            sys.stderr.write(f"[air] run store: {type(exc).__name__}: {exc}\n")
            return None

    @property
    def paths(self) -> Any:
        from air.runs.paths import RunPaths

        return RunPaths(self.run_id)

    def running(self) -> int:
        from air.runs.states import RunStatus

        attempt = self._safe(self.store.start_attempt, self.run_id)
        self.attempt = attempt.index if attempt is not None else 0
        self._safe(self.store.transition, self.run_id, RunStatus.RUNNING)
        return self.attempt

    def cancel_requested(self) -> bool:
        from air.runs.states import RunStatus

        run = self._safe(self.store.get_run, self.run_id)
        return run is not None and run.status in (RunStatus.TERMINATING, RunStatus.CANCELED)

    def finish(self, status: str, reason: str | None = None, failure_class: str | None = None) -> None:
        """status: SUCCESS, FAILED, CANCELED, TIMEDOUT; goes through TERMINATING where the state machine wants."""
        from air.runs.states import FailureClass, RunStatus

        target = RunStatus(status)
        klass = FailureClass(failure_class) if failure_class else None
        run = self._safe(self.store.get_run, self.run_id)
        if run is None or run.status.is_terminal():
            return
        if target is RunStatus.CANCELED and run.status is RunStatus.RUNNING:
            self._safe(self.store.transition, self.run_id, RunStatus.TERMINATING)
        self._safe(self.store.transition, self.run_id, target, reason=reason, failure_class=klass)


# ---- the call ------------------------------------------------------------------------------------


class _RemoteCall:
    """One remote call from allocation to result (see the module docstring)."""

    def __init__(self, backend: Any, record: RemoteRunRecord, accelerator: AcceleratorType, num_nodes: int,
                 payload: bytes, name: str, timeout_s: float | None, echo: bool, extra_env: dict[str, str],
                 preload: tuple[str, ...]) -> None:
        self.backend = backend
        self.record = record
        self.accelerator = accelerator
        self.num_nodes = num_nodes
        self.per_node = accelerator.per_node
        self.world = accelerator.per_node * num_nodes
        self.payload = payload
        self.name = name
        self.timeout_s = timeout_s
        self.echo = echo
        self.extra_env = extra_env
        self.preload = preload
        self.warm = warm_enabled()  # as for a local call: every node forks its ranks from one zygote
        self.call_dir = CallPaths(record.run_id).create()  # `air logs ID --rank N` reads it
        self.tracking: Any = None
        self._echo_lock = threading.Lock()
        self._next_cancel_check = 0.0

    def _say(self, text: str) -> None:
        if self.echo:
            sys.stderr.write(f"[air] {text}\n")
            sys.stderr.flush()

    def _should_stop(self) -> bool:
        now = time.monotonic()
        if now < self._next_cancel_check:
            return False
        self._next_cancel_check = now + CANCEL_CHECK_S
        return self.record.cancel_requested()

    def run(self) -> list[Any]:
        record = self.record
        self._say(f"run {record.run_id}: {self.world} rank(s) on {self.num_nodes} node(s) of "
                  f"{self.accelerator.name} ({self.backend.address})")
        allocation = None
        try:
            allocation = self.backend.acquire(record.run_id, self.accelerator, self.num_nodes,
                                              should_stop=self._should_stop, on_wait=self._say)
            if allocation is None:
                record.finish("CANCELED", "Canceled while waiting for capacity.", "CANCEL")
                raise WorkloadFailureException(f"Run {record.run_id} was canceled while waiting for capacity.")
            mismatches = self.backend.version_mismatches(allocation)
            if mismatches:
                message = ("The Ray nodes' Python environment does not match this one, so the pickled call "
                           "cannot be loaded there:\n  " + "\n  ".join(mismatches))
                record.finish("FAILED", message, "SETUP")
                raise RuntimeConfigurationError(
                    message, hint="Install the same Python, cloudpickle and torch versions on the cluster's "
                    "nodes as here (or run from an environment that matches the cluster).")
            self.tracking = self._start_tracking()
            values = self._attempt(allocation)
            self._end_tracking("FINISHED")
            return values
        except KeyboardInterrupt:
            record.finish("CANCELED", "Canceled by user signal.", "CANCEL")
            self._end_tracking("KILLED", "Canceled by user signal.")
            self._say(f"run {record.run_id} canceled; every rank was ended")
            raise
        except BaseException as exc:
            self._end_tracking("FAILED", f"{type(exc).__name__}: {exc}"[:500])
            raise
        finally:
            if allocation is not None:
                self.backend.release(allocation)

    def _start_tracking(self) -> Any:
        """The call's MLflow run (air's tracking library; never fails the call), linked to the run."""
        from air.distributed.tracked import tracking_enabled

        if not tracking_enabled():
            return None
        try:
            from air.tracking.call import start_call_run

            handle = start_call_run(self.name, tags={"air.run_id": self.record.run_id, "air.backend": "ray"},
                                    warn=self._say)
        except Exception as exc:  # noqa: BLE001
            self._say(f"tracking: {type(exc).__name__}: {exc}")
            return None
        if handle is not None:
            self.record._safe(self.record.store.set_mlflow_run_id, self.record.run_id, handle.run_id)
        return handle

    def _end_tracking(self, status: str, reason: str | None = None) -> None:
        handle, self.tracking = self.tracking, None
        if handle is None:
            return
        try:
            for rank in range(self.world):
                path = self.call_dir / f"rank_{rank}.log"
                if path.is_file():
                    handle.log_rank_log(path, rank)
            handle.end(status, reason)
        except Exception as exc:  # noqa: BLE001 - tracking never fails a call
            self._say(f"tracking: {type(exc).__name__}: {exc}")

    def _attempt(self, allocation: Any) -> list[Any]:
        from air.backends.ray_backend import NODE_DIR, NODE_PYTHON, NodeLaunch, NodeProcess

        record = self.record
        attempt = record.running()
        log_paths = [self.call_dir / f"rank_{r}.log" for r in range(self.world)]
        base = {
            "AIR_SYS_PATH": json.dumps([p for p in sys.path if p]), "AIR_CALL_DIR": NODE_DIR,
            "NUM_NODES": str(self.num_nodes), "AIR_RUN_ID": record.run_id,
            "AIR_ACCELERATOR_TYPE": self.accelerator.name, RANK_PRELOAD_ENV: ",".join(self.preload),
        }
        if self.tracking is not None:
            base.update(self.tracking.env())
        else:
            for key in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME"):
                if os.environ.get(key):
                    base[key] = os.environ[key]
        base.update(self.extra_env)
        launches = []
        for node in range(self.num_nodes):
            procs = []
            for local in range(self.per_node):
                rank = node * self.per_node + local
                env = rank_env(base, rank=rank, local_rank=local, world_size=self.world,
                               local_world_size=self.per_node, node_rank=node, master_addr="", master_port=0,
                               gpu_ids=None, accelerator_kind=self.accelerator.kind)
                procs.append(NodeProcess(name=f"rank {rank}", argv=[NODE_PYTHON, "-m", "air.distributed.worker", NODE_DIR],
                                         env=env, log_path=log_paths[rank], cwd=os.getcwd()))
            launches.append(NodeLaunch(node_rank=node, processes=procs, log_path=record.paths.node_log(attempt, node),
                                       files={"payload.pkl": self.payload},
                                       warm_preload=self.preload if self.warm else None))
        handle = self.backend.start_node_processes(allocation, launches, tag=f"air-{record.run_id}-{attempt}",
                                                   on_line=self._on_line)
        self._say(f"run {record.run_id} running; MASTER_ADDR={handle.master_addr} MASTER_PORT={handle.master_port}")
        outcome = handle.wait(timeout_s=self.timeout_s, should_stop=self._should_stop)
        exits: list[ProcessExit] = []
        outcomes: list[Any] = [None] * self.world
        for node in range(self.num_nodes):
            names = [f"rank_{node * self.per_node + local}.outcome" for local in range(self.per_node)]
            for name, data in handle.fetch_files(node, names).items():
                if data is not None:
                    (self.call_dir / name).write_bytes(data)
            for proc in handle.process_exits(node) or []:
                rank = node * self.per_node + proc["index"]
                exits.append(ProcessExit(rank, proc["name"], proc["returncode"], proc.get("ended_at"),
                                         bool(proc.get("killed_by_launcher"))))
        for rank in range(self.world):
            outcomes[rank] = read_outcome(self.call_dir, rank)
        known = {e.index for e in exits}
        exits += [ProcessExit(r, f"rank {r}", None, None, True) for r in range(self.world) if r not in known]
        exits.sort(key=lambda e: e.index)
        if outcome.stopped:
            record.finish("CANCELED", "Canceled by the user (air cancel).", "CANCEL")
            raise WorkloadFailureException(f"Run {record.run_id} was canceled; every rank was ended.")
        if outcome.lost_node:
            reason = f"{outcome.lost_node}; the call is not retried (rank logs: {self.call_dir})"
            record.finish("FAILED", reason, "INFRASTRUCTURE")
            raise WorkloadFailureException(f"Run {record.run_id} failed: {reason}")
        result = LaunchResult(exits, None, timed_out=outcome.timed_out)
        try:
            values = resolve(outcomes, result, log_paths, timeout_s=self.timeout_s)
        except BaseException as exc:
            if outcome.timed_out:
                record.finish("TIMEDOUT", f"Ran past its timeout of {self.timeout_s:g} s.", "TIMEOUT")
            else:
                record.finish("FAILED", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:500],
                              "USER_CODE")
            raise
        finally:
            for rank in range(self.world):
                (self.call_dir / f"rank_{rank}.outcome").unlink(missing_ok=True)
        record.finish("SUCCESS")
        return values

    def _on_line(self, node: int, index: int, stream: str, text: str) -> None:
        if not self.echo:
            return
        out = sys.stderr if stream == "stderr" else sys.stdout
        with self._echo_lock:
            try:
                out.write(f"[node {node} rank {node * self.per_node + index}] {text}\n")
                out.flush()
            except (ValueError, OSError):
                pass


__all__ = ["RemoteRunRecord", "plan_shape", "run_remote"]
