"""Benchmark the run store at 100,000 runs: `air list runs` must answer well under a second.

    .venv/bin/python benchmarks/bench_store.py [--runs 100000] [--repeat 7]

A temporary AIR_HOME is filled with `--runs` runs through `RunStore.insert_runs` (one transaction):
mostly ended runs over many experiments and accelerator types, a handful still active (their
supervisor is this process, so `air`'s check for dead supervisors leaves them alone). Figures are
medians over `--repeat` runs, in milliseconds:

* in process: `RunStore().list_runs(...)` as the CLI calls it (default, --all-status, with filters),
  `get_run` by full id, by prefix and by the 8 hex digits, one `transition`;
* whole process: `python -m air.cli.main list runs --all-status` (and without --all-status) with
  AIR_HOME set: interpreter start-up, imports, the supervisor check and the query; beside it
  `python -c pass` and `python -c "import air.cli.main"` for the floor. Skipped, with a message,
  while `air.cli.main` does not exist.
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parent))
import argparse
import importlib.util
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from timing import median_ms  # noqa: E402

EXPERIMENTS = ("qwen-sft", "llama-dpo", "vit-cifar", "bert-mlm", "resnet50", "mistral-rl", "t5-xl", "gpt2")
SHAPES = (("GPU_1xA10", 1, 1), ("GPU_8xH100", 8, 1), ("GPU_8xH100", 16, 2), ("GPU_1xH100", 1, 1),
          ("CPU_2xCPU", 2, 1), ("GPU_8xB300", 32, 4))
ENDED = ("SUCCESS", "FAILED", "CANCELED", "TIMEDOUT", "SUCCESS", "SUCCESS")
SPEC = """experiment_name: {exp}
compute:
  num_accelerators: {n}
  accelerator_type: {acc}
command: |
  python train.py --lr 3e-4 --epochs 3
"""


def fill(home: Path, count: int) -> tuple[float, list[str]]:
    """Insert `count` runs; returns the seconds it took and a few ids to look up."""
    from air.store.states import FailureClass, RunStatus
    from air.store.run_store import Run, RunStore, process_create_time

    me, my_start = os.getpid(), process_create_time(os.getpid())
    base = time.time() - count * 60.0
    runs: list[Run] = []
    for i in range(count):
        exp = f"{EXPERIMENTS[i % len(EXPERIMENTS)]}-{i % 97}"
        acc, n, nodes = SHAPES[i % len(SHAPES)]
        active = i >= count - 10
        status = RunStatus.RUNNING if active else RunStatus(ENDED[i % len(ENDED)])
        submitted = base + i * 60.0
        runs.append(Run(
            id=f"run-{time.strftime('%y%m%d', time.gmtime(submitted))}-{secrets.token_hex(4)}", experiment=exp,
            status=status,
            accelerator_type=acc, num_accelerators=n, num_nodes=nodes, submitted_at=submitted,
            spec_yaml=SPEC.format(exp=exp, n=n, acc=acc), user="bench", started_at=submitted + 5,
            ended_at=None if active else submitted + 50,
            termination_reason="ValueError: bad lr" if status is RunStatus.FAILED else None,
            failure_class=FailureClass.USER_CODE if status is RunStatus.FAILED else None,
            supervisor_pid=me if active else None, supervisor_started_at=my_start if active else None,
            current_attempt=0,
        ))
    store = RunStore(home / "runs.db")
    t0 = time.perf_counter()
    store.insert_runs(runs)
    elapsed = time.perf_counter() - t0
    store.close()
    return elapsed, [runs[0].id, runs[count // 2].id, runs[-1].id]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--keep", action="store_true", help="keep the filled AIR_HOME and print its path")
    args = parser.parse_args()

    home = Path(tempfile.mkdtemp(prefix="air-bench-store-"))
    os.environ["AIR_HOME"] = str(home)
    try:
        from air.store.run_store import RunStore

        seconds, ids = fill(home, args.runs)
        size_mb = sum(p.stat().st_size for p in home.glob("runs.db*")) / 1e6
        print(f"filled {args.runs:,} runs in {seconds:.2f} s ({size_mb:.0f} MB on disk incl. WAL)")

        store = RunStore()
        new = store.create_run(experiment="bench-new", accelerator_type="CPU_1xCPU", num_accelerators=1,
                               num_nodes=1).run
        print(f"\nin process, median of {args.repeat} (ms):")
        cases: list[tuple[str, Callable[[], Any]]] = [
            ("list_runs() (active, limit 20)", lambda: store.list_runs()),
            ("list_runs(statuses='all')", lambda: store.list_runs(statuses="all")),
            ("list_runs(all, experiment_glob='qwen*')", lambda: store.list_runs(statuses="all", experiment_glob="qwen*")),
            ("list_runs(all, accelerator_type='b300')", lambda: store.list_runs(statuses="all", accelerator_type="b300")),
            ("list_runs(all, num_accelerators=32)", lambda: store.list_runs(statuses="all", num_accelerators=32)),
            ("list_runs(all, glob matching nothing)", lambda: store.list_runs(statuses="all", experiment_glob="zzz*")),
            ("get_run(full id)", lambda: store.get_run(ids[1])),
            ("get_run(id prefix, 2 hex digits short)", lambda: store.get_run(ids[1][:-2])),
            ("get_run(6 of the 8 hex digits)", lambda: store.get_run(ids[1][-8:-2])),
            ("set_mlflow_run_id (one write transaction)", lambda: store.set_mlflow_run_id(new.id, "mlflow-run")),
        ]
        for name, fn in cases:
            fn()  # warm: the first query of a process opens the connection and checks the schema
            print(f"  {name:<44} {median_ms(fn, args.repeat):8.2f}")
        cold = [sys.executable, "-c", "import time, sys; t=time.perf_counter(); from air.store.run_store import RunStore; "
                "RunStore().list_runs(statuses='all'); print(time.perf_counter()-t)"]
        firsts = [float(subprocess.run(cold, capture_output=True, text=True, check=True).stdout)
                  for _ in range(args.repeat)]
        print(f"  {'first list_runs in a new process (import+open)':<44} {statistics.median(firsts) * 1000:8.2f}")

        print(f"\nwhole process, median of {args.repeat} (ms):")
        floor = [("python -c pass", [sys.executable, "-c", "pass"])]
        if importlib.util.find_spec("air.cli.main") is None:
            print("  (skipped `air list runs`: air.cli.main does not exist yet)")
            commands = floor
        else:
            commands = floor + [
                ("python -c 'import air.cli.main'", [sys.executable, "-c", "import air.cli.main"]),
                ("air list runs", [sys.executable, "-m", "air.cli.main", "list", "runs"]),
                ("air list runs --all-status", [sys.executable, "-m", "air.cli.main", "list", "runs", "--all-status"]),
            ]
        for name, cmd in commands:
            def call(cmd: list[str] = cmd) -> None:
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=os.environ.copy())
            call()
            print(f"  {name:<44} {median_ms(call, args.repeat):8.1f}")
    finally:
        if args.keep:
            print(f"\nkept AIR_HOME={home}")
        else:
            shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
