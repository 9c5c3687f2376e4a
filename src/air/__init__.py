"""air: an open, self-hosted AI Runtime for distributed training.

`@distributed` runs a function once per accelerator and returns every rank's result; `air run`
runs workloads; `ray_launch` starts a Ray cluster over a call's nodes. Heavy parts (MLflow, Ray) are
imported only where they are used, so `import air` stays fast and never imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from air.distributed import DistributedFunction, distributed
from air.errors import (
    AirError,
    GPUTypeError,
    GPUValidationError,
    HangError,
    LocalExecutionTimeoutError,
    RankFailedError,
    RuntimeConfigurationError,
    SerializationError,
    UserInputError,
    WorkloadFailureException,
)
from air.runtime import (
    get_global_rank,
    get_local_rank,
    get_local_world_size,
    get_node_ip,
    get_node_rank,
    get_replica_rank,
    get_world_size,
    ray_init,
)

__version__ = "0.1.0"

if TYPE_CHECKING:
    from air.client.sdk import Client


def __getattr__(name: str) -> Any:  # ray_launch needs ray: import it only when asked for
    if name in ("ray_launch", "RayMetricsMonitor"):
        from air import ray as _ray

        return getattr(_ray, name)
    if name == "Client":  # the SDK (pydantic, the run store): only when asked for, so `import air` stays fast
        from air.client.sdk import Client

        return Client
    raise AttributeError(f"module 'air' has no attribute {name!r}")


__all__ = [
    "AirError", "Client", "DistributedFunction", "GPUTypeError", "GPUValidationError", "HangError", "LocalExecutionTimeoutError",
    "RankFailedError", "RayMetricsMonitor", "RuntimeConfigurationError", "SerializationError", "UserInputError",
    "WorkloadFailureException", "distributed", "get_global_rank", "get_local_rank", "get_local_world_size",
    "get_node_ip", "get_node_rank", "get_replica_rank", "get_world_size", "ray_init", "ray_launch",
]
