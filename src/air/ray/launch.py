"""`ray_launch`: `@distributed`, but the ranks first become a Ray cluster and the function runs once,
as the Ray driver, on global rank 0.

Every call gets its own cluster: the head on node 0 with its GCS on MASTER_PORT (a port air already
reserved free on node 0), the other nodes joining it; each node advertises its GPUs (`--num-gpus`)
and `accelerator_type:<MODEL>`, so `ScalingConfig(use_gpu=True, accelerator_type="H100")` and
fractional `resources_per_worker={"GPU": 0.5}` schedule. Ports and temp dirs are its own, token
authentication uses a fresh per-call token, and teardown ends only that cluster's processes.

Only local rank 0 of each node takes part; the other ranks return None at once. Nodes other than 0
stay up until the head goes away (the driver finished), then stop their own Ray node.
`.distributed()` returns `[driver's value, None, …]`, one entry per rank, as `@distributed` does.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, TypeVar, overload

from air.constants import DEFAULT_DISTRIBUTED_TIMEOUT_S, RAY_JOIN_TIMEOUT_S
from air.distributed.decorator import DistributedFunction
from air.distributed.shape import CallSettings, check_settings
from air.errors import AirError, RayInitializationError
from air.settings import (
    AIR_ACCELERATOR_KIND,
    AIR_ACCELERATOR_TYPE,
    AIR_RAY_METRICS,
    AIR_RAY_METRICS_PORT,
    AIR_RAY_OBJECT_STORE_MEMORY,
)

if TYPE_CHECKING:
    from air.backends.ray_cluster import RayAuth
    from air.ray.metrics import RayMetricsMonitor

_log = logging.getLogger("air.ray.launch")

P = ParamSpec("P")
R = TypeVar("R")


class RayLaunchBootstrap:
    """What every rank of a `ray_launch` call runs (pickled with the user's function)."""

    def __init__(self, func: Callable[..., object], token: str, model: str | None, kind: str | None,
                 dashboard: bool = True) -> None:
        self.func = func
        self.token = token
        self.model = model
        self.kind = kind
        self.dashboard = dashboard
        self.__name__ = getattr(func, "__name__", "ray_launch")
        self.__qualname__ = getattr(func, "__qualname__", self.__name__)

    def __call__(self, *args: object, **kwargs: object) -> object:
        if int(os.environ.get("LOCAL_RANK", "0")) != 0:
            return None
        from air.backends.ray_cluster import RayAuth, start_ray_node, use_auth
        from air.distributed.mlflow_gate import use_mlflow

        use_mlflow(wait=False)  # a lazily made call run is made while the Ray node starts (_node_monitor waits)

        node_rank = int(os.environ.get("NODE_RANK", "0"))
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        num_nodes = int(os.environ.get("NUM_NODES") or int(os.environ.get("WORLD_SIZE", "1")) // max(per_node, 1))
        host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])
        auth = RayAuth("token", self.token)
        kind, model = self._shape()
        gpus = 0
        if kind == "GPU":
            visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
            gpus = len(visible) or per_node
        resources = {f"accelerator_type:{model}": 1} if kind == "GPU" and model else None
        common: dict[str, Any] = {
            "auth": auth, "num_gpus": gpus,
            "num_cpus": max(per_node, os.cpu_count() or 1) if kind == "CPU" else None,
            "resources": resources,
            "object_store_memory": (
                int(os.environ[AIR_RAY_OBJECT_STORE_MEMORY]) if os.environ.get(AIR_RAY_OBJECT_STORE_MEMORY) else None
            ),
            "labels": {"air-node-rank": str(node_rank)},
        }
        if node_rank != 0:
            node = start_ray_node(head=False, address=f"{host}:{port}", retry_until=time.monotonic() + RAY_JOIN_TIMEOUT_S,
                                  **common)
            monitor = _node_monitor(node.metrics_export_port)
            try:
                print(f"[air] node {node_rank} joined the Ray cluster at {host}:{port}", flush=True)
                _wait_head_gone(host, port)
            finally:
                if monitor is not None:
                    monitor.finish()
                node.stop()
            return None
        from air.progress import spinner

        address = f"{host}:{port}"
        _log.info("starting the Ray head at %s for %d node(s)", address, num_nodes)
        with spinner(f"starting a Ray cluster at {address} ({num_nodes} node(s)) …"):  # on a terminal only
            node = start_ray_node(head=True, gcs_port=port, include_dashboard=self.dashboard, **common)
        monitor = None
        try:
            use_auth(auth)  # the driver (this process) is a client of the new cluster from here on
            os.environ["RAY_ADDRESS"] = address
            with spinner(f"waiting for {num_nodes - 1} Ray node(s) to join {address} …"):
                joined = _wait_for_nodes(address, num_nodes, auth)
            print(f"[air] Ray cluster up at {address}: {joined} of {num_nodes} node(s)"
                  + (f", dashboard {node.dashboard_url}" if node.dashboard_url else ""), flush=True)
            os.environ[AIR_RAY_METRICS_PORT] = str(node.metrics_export_port)
            monitor = _driver_tracking(node.metrics_export_port)
            return self.func(*args, **kwargs)
        finally:
            if monitor is not None:
                monitor.finish()
            _shutdown_driver()
            node.stop()

    def _shape(self) -> tuple[str, str | None]:
        if self.kind:
            return self.kind, self.model
        text = os.environ.get(AIR_ACCELERATOR_TYPE, "")
        if text:
            from air.accelerators import parse_accelerator_type

            parsed = parse_accelerator_type(text)
            return parsed.kind, parsed.model
        kind = os.environ.get(AIR_ACCELERATOR_KIND, "CPU")
        if kind == "GPU":
            from air.accelerators import discover

            return kind, discover().gpu_model
        return kind, None


def _driver_tracking(port: int) -> RayMetricsMonitor | None:
    """The driver's tracking, before the user's function runs: the head's RayMetricsMonitor, then Ray
    Train's report callback. In this order: `_node_monitor` waits for a lazily made call run, and the
    callback is added only when MLFLOW_RUN_ID is set. The other way round, a call whose run the caller made
    after the Ray head was up (its `import mlflow` and a fresh store's schema took 18 s on the loaded dev
    VM, the head's start less) lost every `ray.train.report` although the run existed before `fit()`."""
    monitor = _node_monitor(port, head=True)
    from air.backends.ray_train_report import enable_train_report_logging

    enable_train_report_logging()
    return monitor


def _node_monitor(port: int, head: bool = False) -> RayMetricsMonitor | None:
    """This node's RayMetricsMonitor, started, when the call has an MLflow run (and metrics are on).

    A call tracked lazily gets its run here even if the function never imports mlflow: Ray's metrics and
    Ray Train's reports (air.ray.train_callback, which reads MLFLOW_RUN_ID when `fit()` starts) are use."""
    from air.distributed.mlflow_gate import use_mlflow

    use_mlflow()
    if not os.environ.get("MLFLOW_RUN_ID") or os.environ.get(AIR_RAY_METRICS, "1") == "0":
        return None
    from air.ray.metrics import RayMetricsMonitor

    monitor = RayMetricsMonitor(os.environ["MLFLOW_RUN_ID"], is_head_node=head,
                                metrics_url=f"http://127.0.0.1:{port}/metrics")
    monitor.start()
    return monitor


def _shutdown_driver() -> None:
    import sys

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        try:
            ray.shutdown()
        except Exception:  # the cluster is being stopped anyway
            pass


def _wait_for_nodes(address: str, expected: int, auth: RayAuth, timeout_s: float = RAY_JOIN_TIMEOUT_S) -> int:
    """Alive nodes once `expected` have joined (or the timeout passed); asks the GCS directly, so the
    user's own `ray.init(...)` (with its runtime_env) is the driver's first and only connection."""
    if expected <= 1:
        return 1
    # ray's _raylet.pyi stub lists only part of the compiled module; GcsClient is there at run time.
    from ray._raylet import GcsClient  # type: ignore[attr-defined]

    client = GcsClient(address=address)
    deadline = time.monotonic() + timeout_s
    alive = 0
    while time.monotonic() < deadline:
        try:
            infos = client.get_all_node_info(timeout=5)
            alive = sum(1 for info in infos.values() if int(getattr(info, "state", 1)) == 0)
        except Exception:  # the GCS may still be starting
            alive = 0
        if alive >= expected:
            return alive
        time.sleep(0.5)
    raise RayInitializationError(
        f"Failed to start a ray cluster: {alive} of {expected} nodes joined {address} within {timeout_s:g} s.",
        hint="The other nodes' logs (air logs RUN --node N) show why they could not join.",
    )


def _wait_head_gone(host: str, port: int, interval_s: float = 1.0) -> None:
    """Block while the head's GCS port answers; two refusals in a row mean the driver is done."""
    misses = 0
    while misses < 2:
        try:
            with socket.create_connection((host, port), timeout=2):
                misses = 0
        except OSError:
            misses += 1
        time.sleep(interval_s)


class RayLaunchFunction(DistributedFunction[P, R], Generic[P, R]):
    """A `ray_launch`-decorated function: `.distributed()` runs it once as the Ray driver on rank 0."""

    def with_overrides(self, *args: Any, **kwargs: Any) -> RayLaunchFunction[P, R]:
        plain = super().with_overrides(*args, **kwargs)
        return RayLaunchFunction(self.raw_func, plain._settings)

    def distributed(self, *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """Start a Ray cluster over the call's nodes, run the function as its driver, return
        `[driver's value, None, …]` (one entry per rank)."""
        import secrets

        try:
            import ray  # noqa: F401
        except ImportError as exc:
            raise ImportError("ray_launch needs Ray: pip install 'air-runtime[ray]'") from exc
        call_args, call_kwargs = self._bind(args, kwargs)
        settings = self._settings
        token = secrets.token_hex(16)
        try:
            if settings.remote:
                from air.distributed.remote import run_remote

                boot = RayLaunchBootstrap(self.raw_func, token, None, None)
                return run_remote(boot, call_args, call_kwargs, settings)
            from air.distributed.local import run_local
            from air.distributed.shape import resolve_local

            shape = resolve_local(settings)
            boot = RayLaunchBootstrap(self.raw_func, token, shape.accelerator.model, shape.accelerator.kind)
            return run_local(boot, call_args, call_kwargs, settings)
        except Exception as exc:
            if isinstance(exc, AirError) or hasattr(exc, "air_rank"):
                raise exc.with_traceback(None) from exc.__cause__
            raise


@overload
def ray_launch(func: Callable[P, R], /) -> RayLaunchFunction[P, R]: ...


@overload
def ray_launch(num_accelerators: int | None = None, accelerator_type: str | None = None, remote: bool = False,
               timeout: float | None = DEFAULT_DISTRIBUTED_TIMEOUT_S, *, gpus: int | None = None,
               gpu_type: str | None = None) -> Callable[[Callable[P, R]], RayLaunchFunction[P, R]]: ...


def ray_launch(num_accelerators: object = None, accelerator_type: object = None, remote: object = False,
               timeout: object = DEFAULT_DISTRIBUTED_TIMEOUT_S, *, gpus: object = None, gpu_type: object = None,
               ) -> object:
    """Like `@distributed` (same arguments), but the nodes become a Ray cluster and the function runs
    once as its driver: `@ray_launch(gpus=16, gpu_type='H100', remote=True)`, then `fn.distributed()`."""
    if callable(num_accelerators) and not isinstance(num_accelerators, (int, bool)):
        return RayLaunchFunction(num_accelerators, check_settings(timeout=DEFAULT_DISTRIBUTED_TIMEOUT_S))
    settings: CallSettings = check_settings(num_accelerators, accelerator_type, remote, timeout, gpus, gpu_type)

    def wrap(func: Callable[P, R]) -> RayLaunchFunction[P, R]:
        return RayLaunchFunction(func, settings)

    return wrap

