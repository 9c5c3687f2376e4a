"""`air.ray.shim` is `air.backends.ray_shim` (moved below the backends that use it; one module, two names)."""

import sys

from air.backends import ray_shim

sys.modules[__name__] = ray_shim
