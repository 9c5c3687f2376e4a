"""`air.ray.cluster` is `air.backends.ray_cluster` (moved below the backends that use it; one module, two names)."""

import sys

from air.backends import ray_cluster

sys.modules[__name__] = ray_cluster
