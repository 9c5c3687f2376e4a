"""Where am I? Helpers for code running inside a rank (or a workload node).

They read torch.distributed when it is initialised (and check it agrees with the environment), else
the torchrun-compatible environment air sets, else the single-process default.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import mmap

from air.errors import RuntimeConfigurationError
from air.settings import (
    AIR_ACCELERATOR_KIND,
    AIR_CHECKPOINT_DIR,
    AIR_HEARTBEAT_FILE,
    AIR_RAY_HEAD_PORT,
    AIR_RESUMED,
)

#: A heartbeat writes its slot at most this often; calls in between cost one clock read.
HEARTBEAT_EVERY_S = 0.5


def _dist() -> ModuleType | None:
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


def get_global_rank(group: object = None) -> int:
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


def get_replica_rank() -> int:
    """Which replica of the job this process belongs to (REPLICA_RANK): 0 in every air run, which has one
    replica (its nodes and ranks are one world); the hosted product sets it when a job runs replicas."""
    return _env_int("REPLICA_RANK", 0)


def get_node_ip() -> str:
    """An address of this node other nodes can reach (MASTER_ADDR of node 0 is the same kind): the
    address of the interface that routes outward (the hosted product reads eth0's), else 127.0.0.1."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect(("10.255.255.255", 1))
            return str(sock.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def ray_init(*args: Any, **kwargs: Any) -> Any:
    """Connect this process to the Ray cluster of the air run it runs in (`ray.init(address="auto")`: the
    cluster the workload's `ray start --head` started, found through the run's own RAY_TMPDIR, or
    `ray_launch`'s), print the URL of that cluster's dashboard and return Ray's context. Arguments go to
    `ray.init`. Outside a Ray workload a RuntimeConfigurationError says so (no stray local Ray is started)."""
    if not (os.environ.get("RAY_ADDRESS") or os.environ.get(AIR_RAY_HEAD_PORT)):
        raise RuntimeConfigurationError(
            "ray_init() connects to the Ray cluster of the air run it runs in, and this process is not in a Ray "
            "workload (neither RAY_ADDRESS nor the run's Ray head port is set).",
            hint="Call it from a workload whose command starts Ray on node 0 (`ray start --head`) before this "
            "script, or in a function run by ray_launch; anywhere else call ray.init() yourself.")
    import ray

    if not args:
        kwargs.setdefault("address", "auto")
    try:
        context = ray.init(*args, **kwargs)
    except ConnectionError as exc:
        raise RuntimeConfigurationError(
            f"ray_init(): the Ray cluster of this run is not running: {exc}",
            hint="Start it first: `ray start --head` on node 0 in the workload's command, before the script that "
            "calls ray_init().") from exc
    url = _dashboard_url(getattr(context, "dashboard_url", None))
    print(f"Ray dashboard: {url}" if url else "Ray dashboard: none (the head was started without one)", flush=True)
    return context


def _dashboard_url(address: str | None) -> str | None:
    """`host:port` as Ray reports it, as a link: a dashboard bound to every interface is reached at this
    node's address (`get_node_ip`), not 0.0.0.0."""
    if not address:
        return None
    host, _, port = address.rpartition(":")
    if host in ("0.0.0.0", "::", "[::]"):
        host = get_node_ip()
    return f"http://{host}:{port}" if "://" not in address else address


def default_backend() -> str:
    """'nccl' on a GPU rank, 'gloo' on a CPU one: pass it to `dist.init_process_group`."""
    return "gloo" if os.environ.get(AIR_ACCELERATOR_KIND, "GPU") == "CPU" else "nccl"


_beat_next = 0.0
_beat_slot: mmap.mmap | Literal[False] | None = None  # the mapped slot; False where there is none


def heartbeat() -> None:
    """Tell air this process is making progress (call it every step; it costs well under a microsecond).

    A process that prints lines makes progress already; one that trains silently calls this, so that a
    run's `hang_timeout_minutes` (or `hang_timeout=`) does not take it for hung."""
    global _beat_next
    now = time.monotonic()
    if now < _beat_next:
        return
    _beat_next = now + HEARTBEAT_EVERY_S
    _beat(time.time())


def _beat(when: float) -> None:
    global _beat_slot
    if _beat_slot is None:
        _beat_slot = _map_slot()
    if _beat_slot is not False:
        import struct

        try:
            struct.pack_into("d", _beat_slot, 0, when)
        except (ValueError, TypeError):  # closed
            _beat_slot = False


def _map_slot() -> mmap.mmap | Literal[False]:
    """The launcher's 8-byte slot for this process (AIR_HEARTBEAT_FILE), mapped once; False without one."""
    path = os.environ.get(AIR_HEARTBEAT_FILE)
    if not path:
        return False
    import mmap

    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return False
    try:
        return mmap.mmap(fd, 8)
    except (OSError, ValueError):
        return False
    finally:
        os.close(fd)


def checkpoint_dir() -> str | None:
    """Where this run keeps checkpoints across attempts (AIR_CHECKPOINT_DIR): a folder, or a URI such as
    `s3://...` on a cluster; None outside a run."""
    return os.environ.get(AIR_CHECKPOINT_DIR) or None


def is_resumed() -> bool:
    """True in a retried attempt (AIR_RESUMED=1): load the latest checkpoint before training."""
    return os.environ.get(AIR_RESUMED) == "1"


def latest_checkpoint(root: str | os.PathLike[str] | None = None) -> Path | None:
    """The newest checkpoint below the run's checkpoint folder (or `root`): the most recently modified
    entry at any depth whose name starts with `checkpoint` (Ray Train's `checkpoint_<date>` folders,
    `checkpoint_000042`, `checkpoint.pt`); else the newest entry directly in it. None when empty."""
    base = root if root is not None else checkpoint_dir()
    if not base or "://" in str(base):
        return None
    return newest_checkpoint(Path(base))


def newest_checkpoint(base: Path) -> Path | None:
    """See `latest_checkpoint` (also used by `air get run`)."""
    if not base.is_dir():
        return None
    named: list[tuple[float, Path]] = []
    for dirpath, dirnames, filenames in os.walk(base):
        for name in [*dirnames, *filenames]:
            if name.startswith("checkpoint") and not name.endswith((".tmp", ".lock")):
                path = Path(dirpath) / name
                try:
                    named.append((path.stat().st_mtime, path))
                except OSError:
                    pass
        dirnames[:] = [d for d in dirnames if not d.startswith("checkpoint")]
    if named:
        return max(named)[1]
    entries = []
    for path in base.iterdir():
        try:
            entries.append((path.stat().st_mtime, path))
        except OSError:
            pass
    return max(entries)[1] if entries else None



#: The public helpers (`serverless_gpu.runtime` star-imports them).
__all__ = ["checkpoint_dir", "default_backend", "heartbeat", "is_resumed", "latest_checkpoint", "get_global_rank", "get_local_rank", "get_local_world_size", "get_node_ip",
           "get_node_rank", "get_replica_rank", "get_world_size", "ray_init"]
