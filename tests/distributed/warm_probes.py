"""Rank functions and import-time behaviours for the warm-start tests (a module, so they pickle by reference)."""

from __future__ import annotations

import os
import sys


def lineage() -> dict[str, object]:
    """Who started this rank, and what was imported before the function ran."""
    import psutil

    parent = psutil.Process(os.getppid())
    return {"parent_pid": parent.pid, "parent_cmdline": " ".join(parent.cmdline()), "pid": os.getpid(),
            "sid": os.getsid(0), "torch_preloaded": "torch" in sys.modules}


def uses_torch_rendezvous() -> dict[str, object]:
    """Names torch, so the warm start preloads it and hosts the store the ranks rendezvous on."""
    torch_preloaded = "torch" in sys.modules
    import numpy
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    value = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(value)
    dist.destroy_process_group()
    return {"torch_preloaded": torch_preloaded, "agent_store": os.environ.get("TORCHELASTIC_USE_AGENT_STORE"),
            "sum": float(value), "numpy_draw": float(numpy.random.rand()), "rank": os.environ["RANK"]}


def gc_state() -> dict[str, object]:
    """Names torch (so it is preloaded) but does not import it: what the rank found on entry."""
    import gc

    if os.environ.get("NEVER_SET_BY_ANYONE"):
        import torch  # noqa: F401 - named only, for the preload scan
    garbage = [[]]
    garbage[0].append(garbage)  # a cycle: only the cyclic GC can free it
    del garbage
    return {"gc_enabled": gc.isenabled(), "frozen": gc.get_freeze_count(), "collected": gc.collect(),
            "torch_preloaded": "torch" in sys.modules}


def plain() -> int:
    return int(os.environ["RANK"])


class BlocksWhenReleased:
    """Stands in for torch's process-group destructor deadlock: releasing it never finishes."""

    def __del__(self) -> None:
        import time

        time.sleep(1000)


def leaves_a_deadlocking_object_behind() -> int:
    stuck = BlocksWhenReleased()  # noqa: F841 - released when the frame is, after the result is reported
    return int(os.environ["RANK"]) + 40


def leaves_an_unclosed_file(path: str) -> int:
    out = open(f"{path}.{os.environ['RANK']}", "w")  # closed by its release, as in CPython
    out.write("written before return, flushed when released")
    return 1


_CALLS_SEEN: list[int] = []  # a module global the function changes: a warm call must find it fresh


def remembers() -> dict[str, object]:
    """Who forked this rank (the leader, and the kept zygote above it) and what it found of earlier calls."""
    import psutil

    if os.environ.get("NEVER_SET_BY_ANYONE"):
        import torch  # noqa: F401 - named only: the zygote preloads torch, as for a real training call
    _CALLS_SEEN.append(1)
    leader = psutil.Process(os.getppid())
    return {"pid": os.getpid(), "leader": leader.pid, "zygote": leader.ppid(), "port": os.environ["MASTER_PORT"],
            "seen": len(_CALLS_SEEN), "torch_preloaded": "torch" in sys.modules,
            "user_module_loaded": "warm_user_module" in sys.modules}


def sees_env() -> dict[str, object]:
    """What the rank's environment says, and what its kept zygote's own (its /proc environ) says."""
    import psutil

    zygote = psutil.Process(psutil.Process(os.getppid()).ppid())
    return {"zygote": zygote.pid, "zygote_env": zygote.environ(), "rank": os.environ["RANK"],
            "port": os.environ["MASTER_PORT"]}


def sleeps() -> None:
    """Names torch (the same preload as `remembers`), then blocks until ended."""
    import time

    if os.environ.get("NEVER_SET_BY_ANYONE"):
        import torch  # noqa: F401
    time.sleep(600)
