"""What one run costs in CPU (issue 35: the suite, and a busy workstation, are CPU-bound on process
start-up): `air run -f --watch` of a 2-rank CPU workload on the local backend, from the CLI's start until
every process of the run (the CLI, the supervisor finishing MLflow, the launcher, the ranks) has ended,
with tracking on (the default: the attempt's MLflow run in SQLite) and with `AIR_TRACKING=off`.

    .venv/bin/python benchmarks/bench_run_cpu.py [--reps 5]

CPU is read from a cgroup v1 `cpuacct` group made for the benchmark (root, as on this project's machines):
every process the run starts stays in it whatever its session, so a detached supervisor is counted.
Rounds are interleaved (on, off). Prints the median CPU seconds of each, the wall time beside it, and the
machine's 1-minute load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CPUACCT = Path("/sys/fs/cgroup/cpuacct")
AIR = [sys.executable, "-m", "air.cli.main"]
WORKLOAD = """experiment_name: bench-run-cpu
command: python -c "print('node', __import__('os').environ['NODE_RANK'])"
compute:
  num_accelerators: 2
  accelerator_type: CPU_2xCPU
"""


def group_usage(group: Path) -> float:
    return int((group / "cpuacct.usage").read_text()) / 1e9


def one_run(group: Path, home: Path, spec: Path, tracking: bool) -> tuple[float, float]:
    """CPU seconds and wall seconds of one run, its every process included."""
    env = {**os.environ, "AIR_HOME": str(home), "AIR_TRACKING": "on" if tracking else "off"}
    # The CLI starts inside the group (a small shell moves itself there first): everything it starts stays.
    script = f"echo $$ > {group}/cgroup.procs && exec \"$@\""
    before, start = group_usage(group), time.monotonic()
    done = subprocess.run(["sh", "-c", script, "sh", *AIR, "run", "-f", str(spec), "--watch"], env=env,
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise SystemExit(f"the run failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    while (group / "cgroup.procs").read_text().strip():  # the supervisor may still be ending MLflow's run
        time.sleep(0.05)
    return group_usage(group) - before, time.monotonic() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    if not os.access(CPUACCT, os.W_OK):
        print(f"needs a writable cgroup v1 cpuacct hierarchy at {CPUACCT} (run as root)", file=sys.stderr)
        return 2
    group = CPUACCT / f"air-bench-run-cpu-{os.getpid()}"
    group.mkdir()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            home, spec = Path(tmp) / "home", Path(tmp) / "run.yaml"
            spec.write_text(WORKLOAD)
            one_run(group, home, spec, tracking=True)  # untimed: makes the MLflow store and its schema
            results: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
            loads = []
            for _ in range(args.reps):
                for tracking in (True, False):
                    loads.append(os.getloadavg()[0])
                    results[tracking].append(one_run(group, home, spec, tracking))
    finally:
        deadline = time.monotonic() + 60
        while (group / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.1)  # a failed run's processes ending
        group.rmdir()
    for tracking, runs in results.items():
        cpu = statistics.median(c for c, _ in runs)
        wall = statistics.median(w for _, w in runs)
        print(f"tracking {'on ' if tracking else 'off'}: median CPU {cpu:.2f} s, wall {wall:.2f} s "
              f"(CPU of each: {', '.join(f'{c:.2f}' for c, _ in runs)})")
    print(f"1-minute load during the rounds: {min(loads):.1f}-{max(loads):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
