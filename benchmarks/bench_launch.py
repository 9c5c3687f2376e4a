"""End-to-end wall time of the same trivial 2-rank gloo DDP job through three launchers.

Each sample is a fresh `python` process, as a user would start it: interpreter start, the launcher,
both ranks importing torch, a gloo rendezvous, one DDP step, teardown. Prints medians and ratios.

    .venv/bin/python benchmarks/bench_launch.py [--repeat 7]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

AIR_DRIVER = f"""
import sys
sys.path.insert(0, {str(HERE)!r})
from air import distributed
import trivial_ddp
assert distributed(num_accelerators=2, accelerator_type="CPU")(trivial_ddp.job).distributed() == [2.0, 2.0]
"""

RAY_DRIVER = f"""
import os, sys
sys.path.insert(0, {str(HERE)!r})
os.environ["AIR_BENCH_UNDER_RAY"] = "1"
import ray
from ray.train import ScalingConfig
from ray.train.torch import TorchTrainer
import trivial_ddp
ray.init(num_cpus=2, include_dashboard=False, runtime_env={{"env_vars": {{"AIR_BENCH_UNDER_RAY": "1"}}}})
TorchTrainer(lambda: trivial_ddp.job(), scaling_config=ScalingConfig(num_workers=2, use_gpu=False)).fit()
ray.shutdown()
"""


def timed(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    result = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    elapsed = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"{argv[:3]} failed:\n{result.stderr[-3000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--skip-ray", action="store_true")
    args = parser.parse_args()
    home = tempfile.mkdtemp(prefix="air-bench-")
    env = dict(os.environ, AIR_HOME=home, PYTHONPATH=str(HERE))
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    launchers: dict[str, list[str]] = {
        "air @distributed": [sys.executable, "-c", AIR_DRIVER],
        "air, tracking off": ["env", "AIR_TRACKING=off", sys.executable, "-c", AIR_DRIVER],
        "torchrun --standalone": [torchrun, "--standalone", "--nproc_per_node=2", str(HERE / "trivial_ddp.py")],
    }
    try:
        import ray  # noqa: F401

        if not args.skip_ray:
            launchers["Ray Train TorchTrainer"] = [sys.executable, "-c", RAY_DRIVER]
    except ImportError:
        print("ray is not installed: skipping Ray Train")
    for argv in launchers.values():  # warm the page cache once, not counted
        timed(argv, env)
    samples: dict[str, list[float]] = {name: [] for name in launchers}
    for _ in range(args.repeat):
        for name, argv in launchers.items():  # interleaved, so drift hits every launcher alike
            samples[name].append(timed(argv, env))
    medians = {name: statistics.median(values) for name, values in samples.items()}
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
          f"{args.repeat} runs each, median end-to-end wall time")
    base = medians["torchrun --standalone"]
    for name, median in medians.items():
        spread = f"{min(samples[name]):.2f}–{max(samples[name]):.2f}"
        print(f"  {name:<24} {median:6.2f} s  (range {spread})  {median / base:5.2f}× torchrun")
    shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
