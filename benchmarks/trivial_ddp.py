"""The trivial 2-rank gloo DDP job every launcher runs in bench_launch.py (one step, one all-reduce).

Run as a script it is the torchrun entry point; `job()` is what @distributed and Ray Train call.
"""

from __future__ import annotations


def job() -> float:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    if not dist.is_initialized():  # Ray Train initialises the group itself
        dist.init_process_group("gloo")
    model = DDP(torch.nn.Linear(8, 1))
    loss = model(torch.randn(4, 8)).sum()
    loss.backward()
    value = torch.ones(1)
    dist.all_reduce(value)
    if not _under_ray():
        dist.destroy_process_group()
    return float(value)


def _under_ray() -> bool:
    import os

    return "RAY_TRAIN_SESSION" in os.environ or os.environ.get("AIR_BENCH_UNDER_RAY") == "1"


if __name__ == "__main__":
    job()
