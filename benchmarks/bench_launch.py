"""End-to-end wall time of the same trivial 2-rank gloo DDP job through three launchers.

Each sample is a fresh `python` process, as a user would start it: interpreter start, the launcher,
both ranks importing torch, a gloo rendezvous, one DDP step, teardown. Prints medians and ratios.
"air, cold start" is air with AIR_WARM_START=0 (every rank its own interpreter, as before warm starts).

    .venv/bin/python benchmarks/bench_launch.py [--repeat 7]

`--warm-calls N`: warm calls (issue 17) side by side with torchrun: one process makes N calls of the same
job in a row (a notebook iterating); call 1 starts the zygote (same as a fresh process's call), calls
2..N are forked from the zygote kept since. Prints medians of call 1 and of calls 2..N, and their ratio
to torchrun's end-to-end time for the same job, from interleaved samples.
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


WARM_DRIVER = f"""
import json, sys, time
sys.path.insert(0, {str(HERE)!r})
from air import distributed
import trivial_ddp
from bench_launch import settle
job = distributed(num_accelerators=2, accelerator_type="CPU")(trivial_ddp.job)
times = []
for _ in range(int(sys.argv[1])):
    start = time.perf_counter()
    assert job.distributed() == [2.0, 2.0]
    times.append(time.perf_counter() - start)
    settle()  # the last call's detached MLflow recorder, off the caller's path: not counted
print(json.dumps(times))
"""


def settle() -> None:
    """Wait for air's detached MLflow recorder of the last call (it imports mlflow, ~2 s of CPU) so it
    does not slow whichever launcher's sample comes next. Not counted: it is off the caller's path."""
    import psutil

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        busy = [p for p in psutil.process_iter(["cmdline"])
                if "air.distributed.tracked" in " ".join(p.info["cmdline"] or [])]
        if not busy:
            return
        time.sleep(0.1)


def timed(argv: list[str], env: dict[str, str], aborts: dict[str, int], name: str) -> float:
    """One sample's wall time. A run that fails is run again (at most 3 times) and counted: torch 2.13's
    gloo sometimes aborts at process exit ("terminate called without an active exception") after the
    job itself finished, which torchrun reports as a failed job."""
    for _ in range(3):
        start = time.perf_counter()
        result = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        elapsed = time.perf_counter() - start
        settle()
        if result.returncode == 0:
            return elapsed
        aborts[name] = aborts.get(name, 0) + 1
        last = result.stderr[-3000:]
    raise SystemExit(f"{name}: {argv[:3]} failed 3 times:\n{last}")


def _byte_compile_air() -> None:
    """Give air's modules their .pyc files, as `pip install` does for a regular install (torch's came
    with its wheel). An editable install has none, and where PYTHONDONTWRITEBYTECODE is set (as on the
    developer VM) Python would compile air's modules from source in every process of every sample."""
    import air

    subprocess.run([sys.executable, "-m", "compileall", "-q", str(Path(air.__file__).parent)], check=True)


def warm_calls(calls: int, repeat: int, env: dict[str, str], torchrun: str) -> None:
    """Call 1 and calls 2..N of one process, side by side with torchrun (interleaved runs)."""
    import json

    driver = [sys.executable, "-c", WARM_DRIVER, str(calls)]
    torchrun_argv = [torchrun, "--standalone", "--nproc_per_node=2", str(HERE / "trivial_ddp.py")]
    aborts: dict[str, int] = {}
    timed(torchrun_argv, env, {}, "torchrun")  # warm the page cache once, not counted
    subprocess.run(driver + ["1"], env=env, stdout=subprocess.DEVNULL, check=True)
    first: list[float] = []
    later: list[float] = []
    unkept: list[float] = []
    base: list[float] = []
    for _ in range(repeat):
        done = subprocess.run(driver, env=env, stdout=subprocess.PIPE, text=True, check=True)
        times = json.loads(done.stdout.strip().splitlines()[-1])
        first.append(times[0])
        later.extend(times[1:])
        done = subprocess.run(driver[:-1] + ["1"], env={**env, "AIR_WARM_IDLE_S": "0"}, stdout=subprocess.PIPE,
                              text=True, check=True)
        unkept.append(json.loads(done.stdout.strip().splitlines()[-1])[0])
        base.append(timed(torchrun_argv, env, aborts, "torchrun"))
    median_base = statistics.median(base)
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
          f"{repeat} processes of {calls} calls each, interleaved with {repeat} torchrun runs")
    rows = [("air call 1 (starts the zygote)", first), (f"air calls 2..{calls} (warm)", later),
            ("air call, AIR_WARM_IDLE_S=0", unkept), ("torchrun --standalone", base)]
    for name, values in rows:
        median = statistics.median(values)
        print(f"  {name:<32} {median:6.3f} s  (range {min(values):.3f}–{max(values):.3f}, n={len(values)})"
              f"  {median / median_base:5.3f}× torchrun")
    if aborts:
        print(f"  (torchrun: {aborts['torchrun']} run(s) failed at exit and were rerun)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--skip-ray", action="store_true")
    parser.add_argument("--warm-calls", type=int, metavar="N", default=0,
                        help="time call 1 and calls 2..N of one process against torchrun, instead")
    args = parser.parse_args()
    _byte_compile_air()
    home = tempfile.mkdtemp(prefix="air-bench-")
    # The caller's PYTHONPATH stays behind HERE (a checkout's src/ when run from one).
    env = dict(os.environ, AIR_HOME=home,
               PYTHONPATH=os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p))
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    if args.warm_calls:
        if args.warm_calls < 2:
            parser.error("--warm-calls needs at least 2 calls (call 1, then the warm ones)")
        warm_calls(args.warm_calls, args.repeat, env, torchrun)
        shutil.rmtree(home, ignore_errors=True)
        return
    launchers: dict[str, list[str]] = {
        "air @distributed": [sys.executable, "-c", AIR_DRIVER],
        "air, tracking off": ["env", "AIR_TRACKING=off", sys.executable, "-c", AIR_DRIVER],
        "air, cold start": ["env", "AIR_WARM_START=0", sys.executable, "-c", AIR_DRIVER],
        "torchrun --standalone": [torchrun, "--standalone", "--nproc_per_node=2", str(HERE / "trivial_ddp.py")],
    }
    try:
        import ray  # noqa: F401

        if not args.skip_ray:
            launchers["Ray Train TorchTrainer"] = [sys.executable, "-c", RAY_DRIVER]
    except ImportError:
        print("ray is not installed: skipping Ray Train")
    aborts: dict[str, int] = {}
    for name, argv in launchers.items():  # warm the page cache once, not counted
        timed(argv, env, {}, name)
    samples: dict[str, list[float]] = {name: [] for name in launchers}
    for _ in range(args.repeat):
        for name, argv in launchers.items():  # interleaved, so drift hits every launcher alike
            samples[name].append(timed(argv, env, aborts, name))
    medians = {name: statistics.median(values) for name, values in samples.items()}
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
          f"{args.repeat} runs each, median end-to-end wall time")
    base = medians["torchrun --standalone"]
    for name, median in medians.items():
        spread = f"{min(samples[name]):.2f}–{max(samples[name]):.2f}"
        note = f"  ({aborts[name]} run(s) failed at exit and were rerun)" if aborts.get(name) else ""
        print(f"  {name:<24} {median:6.2f} s  (range {spread})  {median / base:5.2f}× torchrun{note}")
    shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
