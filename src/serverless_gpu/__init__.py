"""Compatibility import path of the hosted product: `from serverless_gpu import distributed`.

Thin re-exports of `air`; no logic lives here.
"""

from air import distributed
from air.distributed import DistributedFunction
from air.errors import *  # noqa: F403 - the same exception names users catch

__all__ = ["DistributedFunction", "distributed"]
