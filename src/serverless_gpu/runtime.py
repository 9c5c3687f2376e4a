"""Compatibility path: `serverless_gpu.runtime` helpers are `air.runtime`'s."""

from air.runtime import *  # noqa: F403
from air.runtime import __all__  # noqa: F401
