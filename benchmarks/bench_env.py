"""Benchmark the environment step: a cache hit, and a cold install with uv beside the same with pip.

    .venv/bin/python benchmarks/bench_env.py [--repeat 5] [--hits 20] [--wheelhouse DIR]

Everything is offline. Without --wheelhouse, a synthetic wheelhouse is written first: 8 pure-Python
wheels that depend on each other in a chain, 150 modules each (about 1,200 files), none of them in the
base interpreter, so every tool installs all of them. Figures are medians, in seconds:

* hit, in process: `parse_dependencies` + `ensure_environment` for dependencies already built, the
  first call in a fresh process (the target is < 0.3 s);
* hit, whole process: the same, with interpreter start-up and `import air.environments`;
* cold, air: `ensure_environment` on a new key with an empty uv cache (uv venv, layering, uv install,
  the check of the base's versions);
* cold, uv: `uv venv` + `uv pip install --no-index --find-links`, empty uv cache;
* cold, pip: `python -m venv` (which seeds pip) + `pip install --no-index --find-links --no-cache-dir`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent / "tests" / "environments"))

from env_wheels import write_wheel  # noqa: E402  (the tests' hand-made wheels: no build backend needed)

PACKAGES = 8
MODULES = 150


def synthetic_wheelhouse(folder: Path) -> list[str]:
    """Wheels `airbench-0` … `airbench-7`, each depending on the next; returns the top-level requirement."""
    body = "".join(f"def f{i}(x):\n    return x * {i} + len('{'x' * 40}')\n\n" for i in range(60))
    for n in range(PACKAGES):
        requires = (f"airbench-{n + 1}",) if n + 1 < PACKAGES else ()
        files = {f"airbench_{n}/__init__.py": f"VALUE = {n}\n"}
        files.update({f"airbench_{n}/mod_{m}.py": body for m in range(MODULES)})
        write_wheel(folder, f"airbench-{n}", "1.0", requires=requires, files=files)
    return ["airbench-0"]


def median_of(fn: Callable[[int], float], repeat: int) -> tuple[float, list[float]]:
    times = [fn(i) for i in range(repeat)]
    return statistics.median(times), times


def run(cmd: list[str], env: dict[str, str] | None = None) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}")


_HIT_PROGRAM = """
import json, sys, time
started = time.perf_counter()
from pathlib import Path
from air.environments import ensure_environment, parse_dependencies
imported = time.perf_counter()
deps = parse_dependencies(json.loads(sys.argv[1]), Path.cwd())
env = ensure_environment(deps, sys.executable, log=lambda line: None)
done = time.perf_counter()
assert env.cache_hit, "expected a cache hit"
print(json.dumps({"call": done - imported, "import": imported - started}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5, help="cold installs per tool (default 5)")
    parser.add_argument("--hits", type=int, default=20, help="cache hits measured (default 20)")
    parser.add_argument("--wheelhouse", type=Path, help="a folder of wheels to install instead of the synthetic set")
    parser.add_argument("--requirement", action="append", help="with --wheelhouse: what to install (repeatable)")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="air-bench-env-"))
    try:
        if args.wheelhouse:
            wheelhouse = args.wheelhouse.resolve()
            requirements = args.requirement or sorted({p.name.split("-")[0] for p in wheelhouse.glob("*.whl")})
        else:
            wheelhouse = work / "wheelhouse"
            requirements = synthetic_wheelhouse(wheelhouse)
        wheels = list(wheelhouse.glob("*.whl"))
        size_mb = sum(p.stat().st_size for p in wheels) / 1e6
        print(f"wheelhouse: {len(wheels)} wheels, {size_mb:.1f} MB; installing {', '.join(requirements)}")
        print(f"python {sys.version.split()[0]} at {sys.executable}; {os.cpu_count()} CPUs\n")

        lines = ["--no-index", f"--find-links {wheelhouse}", *requirements]
        env = dict(os.environ, UV_OFFLINE="1", NO_COLOR="1")
        env.pop("VIRTUAL_ENV", None)

        from uv import find_uv_bin

        uv = find_uv_bin()

        def cold_air(i: int) -> float:
            home = work / f"air-home-cold-{i}"
            program = (
                "import json, sys, time\nfrom pathlib import Path\n"
                "from air.environments import ensure_environment, parse_dependencies\n"
                "deps = parse_dependencies(json.loads(sys.argv[1]), Path.cwd())\n"
                "t = time.perf_counter()\nenv = ensure_environment(deps, sys.executable, log=lambda l: None)\n"
                "assert not env.cache_hit\nprint(time.perf_counter() - t)\n"
            )
            out = subprocess.run(
                [sys.executable, "-c", program, json.dumps(lines)], capture_output=True, text=True, check=True,
                env=dict(env, AIR_HOME=str(home), UV_CACHE_DIR=str(work / f"uv-cache-air-{i}")),
            ).stdout
            return float(out.strip().splitlines()[-1])

        def cold_uv(i: int) -> float:
            venv, cache = work / f"uv-venv-{i}", work / f"uv-cache-{i}"
            started = time.perf_counter()
            run([uv, "venv", "-q", "--python", sys.executable, str(venv)], env)
            run([uv, "pip", "install", "-q", "--python", str(venv / "bin" / "python"), "--no-index",
                 "--find-links", str(wheelhouse), "--cache-dir", str(cache), *requirements], env)
            return time.perf_counter() - started

        venv_seconds: list[float] = []

        def cold_pip(i: int) -> float:
            venv = work / f"pip-venv-{i}"
            started = time.perf_counter()
            run([sys.executable, "-m", "venv", str(venv)], env)
            venv_seconds.append(time.perf_counter() - started)
            run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-index", "--find-links",
                 str(wheelhouse), "--no-cache-dir", "--disable-pip-version-check", *requirements], env)
            return time.perf_counter() - started

        # Cache hits: build once, then time the call in fresh processes.
        home = work / "air-home-hits"
        hit_env = dict(env, AIR_HOME=str(home), UV_CACHE_DIR=str(work / "uv-cache-hits"))
        subprocess.run([sys.executable, "-c", _HIT_PROGRAM.replace("assert env.cache_hit", "pass  #"),
                        json.dumps(lines)], check=True, capture_output=True, env=hit_env)
        hits = [
            json.loads(subprocess.run([sys.executable, "-c", _HIT_PROGRAM, json.dumps(lines)], check=True,
                                      capture_output=True, text=True, env=hit_env).stdout)
            for _ in range(args.hits)
        ]
        hit_call = statistics.median(h["call"] for h in hits)
        hit_whole = statistics.median(h["call"] + h["import"] for h in hits)

        air_med, air_all = median_of(cold_air, args.repeat)
        uv_med, uv_all = median_of(cold_uv, args.repeat)
        pip_med, pip_all = median_of(cold_pip, args.repeat)

        def fmt(values: list[float]) -> str:
            return ", ".join(f"{v:.2f}" for v in values)

        print(f"{'step':44} {'median s':>9}   all runs")
        print(f"{'cache hit, parse + ensure_environment':44} {hit_call:9.3f}   ({args.hits} runs; target < 0.3)")
        print(f"{'cache hit, with start-up + import':44} {hit_whole:9.3f}")
        print(f"{'cold, air ensure_environment (uv)':44} {air_med:9.2f}   {fmt(air_all)}")
        print(f"{'cold, uv venv + uv pip install':44} {uv_med:9.2f}   {fmt(uv_all)}")
        print(f"{'cold, python -m venv + pip install':44} {pip_med:9.2f}   {fmt(pip_all)}")
        print(f"{'  of which python -m venv (with pip)':44} {statistics.median(venv_seconds):9.2f}")
        print(f"\npip / uv: {pip_med / uv_med:.1f}x    pip / air: {pip_med / air_med:.1f}x    "
              f"cold air / hit: {air_med / hit_call:.0f}x")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
