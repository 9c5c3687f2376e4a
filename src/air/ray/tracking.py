"""`air.ray.tracking` is `air.backends.ray_train_report` (moved below the backends that use it; one module, two names)."""

import sys

from air.backends import ray_train_report

sys.modules[__name__] = ray_train_report
