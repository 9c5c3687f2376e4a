"""Where am I? Helpers for code running inside a rank (or a workload node).

They read torch.distributed when it is initialised (and check it agrees with the environment), else
the torchrun-compatible environment air sets, else the single-process default.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any

from air.errors import RuntimeConfigurationError
from air.settings import AIR_ACCELERATOR_KIND


def _dist() -> Any | None:
    """torch.distributed if the user's code already imported and initialised it; never imports torch."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    dist = getattr(torch, "distributed", None)
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist
    except Exception:
        return None
    return None


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError as exc:
        raise RuntimeConfigurationError(f"{name}={value!r} is not an integer.") from exc


def get_global_rank(group: Any = None) -> int:
    """This process's rank among all ranks (RANK); with `group`, its rank in that process group."""
    dist = _dist()
    if dist is not None:
        rank = int(dist.get_rank(group))
        if group is None and "RANK" in os.environ and _env_int("RANK", rank) != rank:
            raise RuntimeConfigurationError(
                f"torch.distributed says rank {rank} but RANK={os.environ['RANK']}; was the process group "
                "initialised with an explicit rank= that disagrees with the launcher?")
        return rank
    if group is not None:
        raise RuntimeConfigurationError("get_global_rank(group) needs torch.distributed to be initialised.")
    return _env_int("RANK", 0)


def get_world_size() -> int:
    """Number of ranks in the whole call (WORLD_SIZE)."""
    dist = _dist()
    if dist is not None:
        size = int(dist.get_world_size())
        if "WORLD_SIZE" in os.environ and _env_int("WORLD_SIZE", size) != size:
            raise RuntimeConfigurationError(
                f"torch.distributed says world size {size} but WORLD_SIZE={os.environ['WORLD_SIZE']}.")
        return size
    return _env_int("WORLD_SIZE", 1)


def get_local_rank() -> int:
    """This process's rank on its node (LOCAL_RANK): also its GPU index, as with torchrun."""
    return _env_int("LOCAL_RANK", 0)


def get_local_world_size() -> int:
    """Ranks on this node (LOCAL_WORLD_SIZE)."""
    return _env_int("LOCAL_WORLD_SIZE", 1)


def get_node_rank() -> int:
    """This node's index among the nodes (NODE_RANK)."""
    return _env_int("NODE_RANK", 0)


def get_node_ip() -> str:
    """An address of this node other nodes can reach (MASTER_ADDR of node 0 is the same kind)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect(("10.255.255.255", 1))
            return str(sock.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def default_backend() -> str:
    """'nccl' on a GPU rank, 'gloo' on a CPU one: pass it to `dist.init_process_group`."""
    return "gloo" if os.environ.get(AIR_ACCELERATOR_KIND, "GPU") == "CPU" else "nccl"


__all__ = ["default_backend", "get_global_rank", "get_local_rank", "get_local_world_size", "get_node_ip",
           "get_node_rank", "get_world_size"]
