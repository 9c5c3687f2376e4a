"""Tracking off the start path (issue 24): a trivial 1-node workload with MLflow tracking on vs off.

    .venv/bin/python benchmarks/bench_tracking_start.py [--reps 5] [--no-server] [--no-ray]

* submit -> first line: from starting the `air run -f wl.yaml --json` process (a fresh CLI process, as a
  user types it) until the node's command has written its first line (its wall-clock time, to a file).
* submit -> SUCCESS: from the same moment until the run store's end time of the run (SUCCESS).
* submit -> tracking done: until the run's supervisor exited (it records the last attempt's MLflow run
  and ends it after the run's SUCCESS); and the supervisor's CPU seconds (user + system, its last sample
  before it exited, 50 ms apart).
Both with tracking on (MLflow: the embedded SQLite store locally; the server's own MLflow through
`air server`) and off (AIR_TRACKING=off), interleaved (on, off, on, ...) so both see the same load; one
warm-up round first (it creates the MLflow store); each rep waits for the run's supervisor to exit, so no
rep's leftover work lands on the next. Beside them `ray job submit --no-wait` on a fresh 1-node Ray
cluster (bench_ray_submit.py's measure: until the entrypoint writes its clock). Medians, min, max.
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parent))
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from server_proc import AIR, BenchServer
from timing import wait_file


def _workload(folder: Path, mark: Path) -> Path:
    spec = folder / f"wl-{mark.name}.yaml"
    spec.write_text("experiment_name: bench-tracking\ncompute: {accelerator_type: CPU_1xCPU, num_accelerators: 1}\n"
                    f"command: |\n  date +%s.%N > {mark}\n  echo hi\n")
    return spec


def _ended(store_path: Path, run_id: str, timeout: float = 300) -> tuple[float, float, float]:
    """The run's end time in the store, once SUCCESS; then waits for its supervisor to exit: (end time,
    the supervisor's exit time, its CPU seconds)."""
    from air.store.run_store import RunStore

    store = RunStore(store_path)
    deadline = time.monotonic() + timeout
    while True:
        run = store.get_run(run_id)
        if run.is_terminal:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"{run_id} still {run.status}")
        time.sleep(0.02)
    assert run.status.value == "SUCCESS", (run.status, run.termination_reason)
    assert run.ended_at is not None
    cpu = float("nan")
    if run.supervisor_pid:
        try:
            proc = psutil.Process(run.supervisor_pid)
            while proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                times = proc.cpu_times()
                cpu = times.user + times.system
                time.sleep(0.05)
        except psutil.NoSuchProcess:
            pass
    return run.ended_at, time.time(), cpu


def bench(envs: dict[str, tuple[dict[str, str], Path]], work: Path, reps: int) -> dict[str, dict[str, list[float]]]:
    """label -> (environment of `air run`, the run store it lands in); interleaved, first round a warm-up."""
    out: dict[str, dict[str, list[float]]] = {label: {"first_line": [], "success": [], "done": [], "cpu": []}
                                              for label in envs}
    for rep in range(reps + 1):
        for label, (env, store_path) in envs.items():
            mark = work / f"{label.replace(' ', '_')}-{rep}"
            spec = _workload(work, mark)
            started = time.time()
            done = subprocess.run([*AIR, "run", "-f", str(spec), "--json"], env=env, check=True, capture_output=True,
                                  text=True)
            run_id = json.loads(done.stdout)["data"]["run_id"]
            first = wait_file(mark, timeout=300)
            ended, done_at, cpu = _ended(store_path, run_id)
            if rep:
                out[label]["first_line"].append(first - started)
                out[label]["success"].append(ended - started)
                out[label]["done"].append(done_at - started)
                out[label]["cpu"].append(cpu)
    return out


class Server(BenchServer):
    """A real `air server` with its MLflow (its runs not walled in: `--single-trust-domain`, as the server
    tests run it), ready once its MLflow answers."""

    def __init__(self, home: Path) -> None:
        super().__init__(home, "--single-trust-domain", mlflow=True, ready_s=600)


def _summary(name: str, values: list[float]) -> str:
    return (f"{name:<58} median {statistics.median(values):6.2f} s   min {min(values):6.2f}   "
            f"max {max(values):6.2f}   (n={len(values)})")


def _report(results: dict[str, dict[str, list[float]]], on: str, off: str) -> None:
    for label in (on, off):
        print(_summary(f"{label}: submit -> first line", results[label]["first_line"]), flush=True)
        print(_summary(f"{label}: submit -> SUCCESS", results[label]["success"]), flush=True)
        print(_summary(f"{label}: submit -> tracking done (supervisor exit)", results[label]["done"]), flush=True)
        print(_summary(f"{label}: supervisor CPU seconds", results[label]["cpu"]), flush=True)
    print(f"load average {os.getloadavg()[0]:.1f}", flush=True)
    for what in ("first_line", "success", "done", "cpu"):
        ratio = statistics.median(results[on][what]) / statistics.median(results[off][what])
        print(f"{on} / {off}, {what.replace('_', ' ')}: {ratio:.2f}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--no-local", action="store_true", help="skip the local (own AIR_HOME) part")
    parser.add_argument("--no-server", action="store_true", help="skip the `air server` part")
    parser.add_argument("--no-ray", action="store_true", help="skip `ray job submit`")
    args = parser.parse_args()
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start, {args.reps} reps (+1 warm-up)",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="air-bench-tracking-") as tmp:
        work = Path(tmp)
        home = work / "home"
        base = {k: v for k, v in os.environ.items() if k not in ("AIR_SERVER_URL", "AIR_TOKEN", "MLFLOW_TRACKING_URI")}
        base["AIR_HOME"] = str(home)
        local = {"local on": ({**base, "AIR_TRACKING": "on"}, home / "runs.db"),
                 "local off": ({**base, "AIR_TRACKING": "off"}, home / "runs.db")}
        if not args.no_local:
            _report(bench(local, work, args.reps), "local on", "local off")
        if not args.no_server:
            servers: list[tuple[str, Server]] = []
            try:
                for label, setting in (("server on", "on"), ("server off", "off")):
                    saved = os.environ.get("AIR_TRACKING")
                    os.environ["AIR_TRACKING"] = setting  # the server's supervisors inherit it
                    try:
                        servers.append((label, Server(work / label.replace(" ", "-"))))
                    finally:
                        if saved is None:
                            os.environ.pop("AIR_TRACKING", None)
                        else:
                            os.environ["AIR_TRACKING"] = saved
                envs = {label: (server.client_env, server.home / "runs.db") for label, server in servers}
                _report(bench(envs, work, args.reps), "server on", "server off")
            finally:
                for _label, server in servers:
                    server.stop()
        if not args.no_ray:
            from bench_server import bench_ray_job

            ray_times = bench_ray_job(work, args.reps)
            if ray_times:
                print(_summary("`ray job submit` CLI: submit -> entrypoint running", ray_times), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
