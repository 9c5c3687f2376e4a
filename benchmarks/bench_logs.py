"""Benchmark reading a 1 GB node log: `air logs --tail 100` must answer well under a second.

    .venv/bin/python benchmarks/bench_logs.py [--gb 1.0] [--repeat 7]

Writes a log of `--gb` GB (lines of about 100 bytes, as a training loop prints them) as node 0 of
attempt 0 of a finished run in a temporary AIR_HOME, then reports medians in milliseconds:

* in process: `tail_lines(path, 100)` (and 10,000, the CLI's default), reading backwards in blocks;
* whole process: `python -m air.cli.main logs RUN_ID --tail 100`, beside `python -c pass`. Skipped,
  with a message, while `air.cli.main` does not exist.

The temporary AIR_HOME (and the 1 GB file) is removed at the end.
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parent))
import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from timing import median_ms  # noqa: E402


def write_log(path: Path, size_bytes: int) -> int:
    """Write about `size_bytes` of numbered log lines; returns the number of lines."""
    path.parent.mkdir(parents=True, exist_ok=True)
    per_block = 10_000
    lines = 0
    with open(path, "wb", buffering=1 << 22) as f:
        written = 0
        while written < size_bytes:
            block = "".join(
                f"[rank{(lines + k) % 8}] step {lines + k:>10} loss {((lines + k) % 997) / 997:.6f} "
                f"lr 3.0e-04 grad_norm 1.2345 tokens/s 123456.7 mem 71.3GiB\n"
                for k in range(per_block)
            ).encode()
            f.write(block)
            written += len(block)
            lines += per_block
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()

    home = Path(tempfile.mkdtemp(prefix="air-bench-logs-"))
    os.environ["AIR_HOME"] = str(home)
    try:
        from air.views.logtail import tail_lines
        from air.store.paths import RunPaths
        from air.store.states import AttemptStatus, RunStatus
        from air.store.run_store import RunStore

        store = RunStore()
        run = store.create_run(experiment="bench-logs", accelerator_type="CPU_1xCPU", num_accelerators=1,
                               num_nodes=1).run
        store.transition(run.id, RunStatus.RUNNING)
        store.start_attempt(run.id)
        store.finish_attempt(run.id, 0, AttemptStatus.SUCCESS, exit_code=0)
        store.transition(run.id, RunStatus.SUCCESS)
        path = RunPaths(run.id).node_log(0, 0)

        t0 = time.perf_counter()
        lines = write_log(path, int(args.gb * (1 << 30)))
        size = path.stat().st_size
        print(f"wrote {size / (1 << 30):.2f} GiB ({lines:,} lines) in {time.perf_counter() - t0:.1f} s: {path}")

        last = tail_lines(path, 100)
        assert len(last) == 100 and f"step {lines - 1:>10}" in last[-1], last[-1]
        print(f"\nin process, median of {args.repeat} (ms):")
        for n in (100, 10_000):
            def tail(n: int = n) -> None:
                tail_lines(path, n)
            print(f"  {f'tail_lines(path, {n})':<44} {median_ms(tail, args.repeat):8.2f}")

        print(f"\nwhole process, median of {args.repeat} (ms):")
        commands: list[tuple[str, list[str]]] = [("python -c pass", [sys.executable, "-c", "pass"])]
        if importlib.util.find_spec("air.cli.main") is None:
            print("  (skipped `air logs`: air.cli.main does not exist yet)")
        else:
            commands.append((f"air logs {run.id} --tail 100",
                             [sys.executable, "-m", "air.cli.main", "logs", run.id, "--tail", "100"]))
        for name, cmd in commands:
            def call(cmd: list[str] = cmd) -> None:
                out = subprocess.run(cmd, check=True, capture_output=True, env=os.environ.copy()).stdout
                if "logs" in cmd:
                    assert out.count(b"\n") == 100, out[-300:]
            call()
            print(f"  {name:<44} {median_ms(call, args.repeat):8.1f}")
    finally:
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
