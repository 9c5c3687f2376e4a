"""Wait until every node of the workload (NUM_NODES) has joined the Ray cluster at RAY_ADDRESS.

The tutorial runs on a cluster that is already up; a workload starts its cluster in the same command,
so the driver waits for the other nodes before sizing the trainer (not needed on one node).
"""

from __future__ import annotations

import os
import sys
import time


def main(timeout_s: float = 300.0) -> int:
    expected = int(os.environ.get("NUM_NODES", "1"))
    import ray

    ray.init()
    deadline = time.monotonic() + timeout_s
    while (alive := sum(1 for node in ray.nodes() if node.get("Alive"))) < expected:
        if time.monotonic() > deadline:
            print(f"only {alive} of {expected} Ray nodes joined within {timeout_s:g} s", file=sys.stderr)
            return 1
        time.sleep(1.0)
    print(f"Ray cluster ready: {alive} node(s), {ray.cluster_resources()}")
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
