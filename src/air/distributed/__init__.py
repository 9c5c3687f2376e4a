"""`@distributed` (see decorator.py), the rank entry point (worker.py) and per-rank outcomes."""

from air.distributed.decorator import DistributedFunction, distributed

__all__ = ["DistributedFunction", "distributed"]
