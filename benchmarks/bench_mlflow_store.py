"""What a fresh embedded MLflow store costs: `air.tracking.prepare_store` on a new AIR_HOME, with MLflow's
migrations run (no schema template in the cache) and started from the template (`schema_template`).

Each try is a fresh interpreter (as a run's supervisor or a new server is); its CPU is measured from its own
resource usage around prepare_store alone (MLflow's import is the same either way, counted separately).
Medians of `--reps` interleaved tries.

    .venv/bin/python benchmarks/bench_mlflow_store.py --reps 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

PROBE = """
import json, os, resource, sys, time
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
began = cpu()
import mlflow.store.tracking.sqlalchemy_store  # MLflow's store module: imported either way
from air.home import AirHome
from air.tracking.store import prepare_store
imported = cpu()
wall = time.monotonic()
prepare_store(f"sqlite:///{AirHome().mlflow_db}")
print(json.dumps({"import": imported - began, "store": cpu() - imported, "wall": time.monotonic() - wall}))
"""


def one(root: Path, cache: Path, label: str, index: int) -> dict[str, float]:
    env = {**os.environ, "AIR_HOME": str(root / f"{label}-{index}"), "XDG_CACHE_HOME": str(cache)}
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {"migrated": [], "template": []}
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        warm_cache = root / "warm-cache"
        one(root, warm_cache, "prime", 0)  # makes the template
        for index in range(args.reps):
            results["migrated"].append(one(root, root / f"empty-cache-{index}", "migrated", index))
            results["template"].append(one(root, warm_cache, "template", index))
    for label, rows in results.items():
        print(f"{label:9s}: prepare_store median CPU {statistics.median(r['store'] for r in rows):.2f} s, "
              f"wall {statistics.median(r['wall'] for r in rows):.2f} s "
              f"(MLflow's import before it: {statistics.median(r['import'] for r in rows):.2f} s CPU)")
    ratio = (statistics.median(r["store"] for r in results["migrated"])
             / max(statistics.median(r["store"] for r in results["template"]), 1e-3))
    print(f"migrations / template: {ratio:.1f}x  (1-minute load {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
