"""Submit → node 0's first line on a real 2-node Slurm cluster: through air vs plain `sbatch` + `srun`
(issue 37: goal ≤ 1.2×). The cluster is the test suite's own (tests/slurm/slurm_cluster.py: munged,
slurmctld and two slurmd on this machine, started here and stopped at the end).

    .venv/bin/python benchmarks/bench_slurm.py [--reps 5] [--json]

* air: `air run -f wl.yaml --watch` of a 2-node workload (CPU_1xCPU × 2, `echo` on each node) with a
  `backend: slurm` profile, timed from the command's start to the line node 0 prints.
* peer: `sbatch --nodes 2 --output FILE` of a batch script whose step is `srun echo ...` (what a Slurm
  user writes by hand), timed from `sbatch`'s start until the line is in the job's output file (polled
  every 10 ms: Slurm writes it when the step prints).
Interleaved (air, peer) after one untimed warm-up of each; the cluster is idle before every sample.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "slurm"), str(ROOT / "tests")]

from slurm_cluster import SlurmCluster  # noqa: E402

MARKER = "node-first-line"
AIR = [sys.executable, "-m", "air.cli.main"]


def air_sample(folder: Path, env: dict[str, str]) -> float:
    """Seconds from `air run --watch` to node 0's line on its output."""
    spec = folder / "wl.yaml"
    spec.write_text("experiment_name: bench-slurm\nmax_retries: 0\ncompute: {num_accelerators: 2, accelerator_type: CPU_1xCPU}\n"
                    f"command: echo {MARKER}-$NODE_RANK\n")
    start = time.perf_counter()
    proc = subprocess.Popen([*AIR, "run", "-f", str(spec), "--watch"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout is not None
    seen = None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if seen is None and f"{MARKER}-0" in line:
            seen = time.perf_counter() - start
    proc.wait(timeout=300)
    if proc.returncode != 0 or seen is None:
        raise RuntimeError(f"air run failed (exit {proc.returncode}):\n{''.join(lines[-30:])}")
    return seen


def peer_sample(folder: Path, env: dict[str, str]) -> float:
    """Seconds from `sbatch` to node 0's line in the job's output file."""
    out = folder / f"peer-{time.monotonic_ns()}.out"
    script = folder / "job.sh"
    script.write_text(f"#!/bin/bash\nsrun bash -c 'echo {MARKER}-$SLURM_NODEID'\n")
    start = time.perf_counter()
    subprocess.run(["sbatch", "--parsable", "--partition", "debug", "--nodes", "2", "--ntasks-per-node", "1",
                    "--output", str(out), str(script)], check=True, capture_output=True, text=True, env=env,
                   timeout=60)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if f"{MARKER}-0" in out.read_text():
                return time.perf_counter() - start
        except FileNotFoundError:
            pass
        time.sleep(0.01)
    raise RuntimeError(f"the sbatch job printed nothing in 300 s: {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print every sample as JSON too")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="air-bench-slurm-") as tmp:
        folder = Path(tmp)
        cluster = SlurmCluster(folder / "cluster")
        cluster.start()
        try:
            home = folder / "air-home"
            home.mkdir()
            (home / "config.yaml").write_text(
                "default_profile: hpc\nprofiles:\n  hpc: {backend: slurm, partition: debug}\n")
            env = {**os.environ, **cluster.env, "AIR_HOME": str(home), "AIR_TRACKING": "off"}
            work = folder / "work"
            work.mkdir()
            air_sample(work, env), peer_sample(work, env)  # warm-up: page cache, Slurm's first job
            samples: dict[str, list[float]] = {"air": [], "peer": []}
            for rep in range(args.reps):
                cluster.idle()
                samples["air"].append(air_sample(work, env))
                cluster.idle()
                samples["peer"].append(peer_sample(work, env))
                load = os.getloadavg()[0]
                print(f"rep {rep + 1}: air {samples['air'][-1]:.2f} s  sbatch+srun {samples['peer'][-1]:.2f} s"
                      f"  (load {load:.1f})", flush=True)
        finally:
            cluster.stop()
    air_median, peer_median = statistics.median(samples["air"]), statistics.median(samples["peer"])
    print(f"submit -> node 0's first line, median of {args.reps}: air {air_median:.2f} s "
          f"({min(samples['air']):.2f}-{max(samples['air']):.2f}), sbatch+srun {peer_median:.2f} s "
          f"({min(samples['peer']):.2f}-{max(samples['peer']):.2f}); ratio {air_median / peer_median:.2f}x")
    if args.json:
        print(json.dumps(samples))


if __name__ == "__main__":
    main()
