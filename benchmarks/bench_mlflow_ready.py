"""How soon the server's MLflow answers (issue 35): `air server start` → MLflow answering through the
door, beside the bare `mlflow server` on the same store.

    .venv/bin/python benchmarks/bench_mlflow_ready.py [--reps 5] [--no-peer]

* air: from starting `air server start` (a fresh process, as a user types it) until
  `GET <server>/mlflow/health` answers 200 through the door; the server's own figure
  (`/api/v1/health`'s `mlflow.ready_after_s`, counted from when it began starting MLflow) beside it.
* peer: `mlflow server --backend-store-uri <the same store>` as MLflow's docs start it (its default 4
  workers), and with `--workers 1` (what air asks of it), until its own `/health` answers 200.
* CPU: user+system seconds of the whole process tree (the air server with its MLflow, or the peer's CLI
  with its uvicorn workers and job runner) when it first answers (for air, its MLflow's processes apart): what the start costs on a quiet machine, where the
  wall time is little more than it. The machine's 1-minute load is shown beside each median.

The store is made (and its schema migrated) by an untimed first start; each rep then starts on it as a
restarted server would. Rounds are interleaved (air, peer, peer-1) so all see the same load.
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parent))
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psutil
from server_proc import AIR, free_port

READY_WITHIN_S = 300.0


def tree_cpu(pid: int) -> tuple[float, float]:
    """User+system CPU seconds of `pid` and of its live descendants (for the air server: its MLflow)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0, 0.0
    found = []
    for proc in procs:
        try:
            times = proc.cpu_times()
            found.append(times.user + times.system)
        except psutil.Error:
            found.append(0.0)
    return found[0], sum(found[1:])


def _answers(url: str, token: str | None) -> bool:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=2) as answer:
            return bool(answer.status == 200)
    except (OSError, urllib.error.HTTPError):
        return False


def _wait(proc: subprocess.Popen[bytes], url: str, token: str | None, started: float) -> tuple[float, float, float]:
    """(seconds from `started` until `url` answers 200, the CPU seconds of `proc` and of its descendants then)."""
    while True:
        if _answers(url, token):
            return (time.monotonic() - started, *tree_cpu(proc.pid))
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode} before {url} answered")
        if time.monotonic() - started > READY_WITHIN_S:
            raise TimeoutError(f"{url} did not answer within {READY_WITHIN_S:g} s")
        time.sleep(0.1)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the process's group (the peer's CLI leaves its uvicorn otherwise), then wait."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


class AirStart:
    """`air server start` on one AIR_HOME, again and again."""

    def __init__(self, home: Path) -> None:
        home.mkdir(parents=True, exist_ok=True)
        base = {k: v for k, v in os.environ.items() if k not in ("AIR_SERVER_URL", "AIR_TOKEN", "MLFLOW_TRACKING_URI")}
        self.env = {**base, "AIR_HOME": str(home)}
        self.home = home
        self.token = subprocess.run([*AIR, "server", "token", "create", "bench", "--admin"], env=self.env, check=True,
                                    capture_output=True, text=True).stdout.strip().splitlines()[-1]

    def once(self) -> dict[str, Any]:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        load = os.getloadavg()[0]
        started = time.monotonic()
        proc = subprocess.Popen([*AIR, "server", "start", "--port", str(port)], env=self.env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            ready_s, own_cpu_s, mlflow_cpu_s = _wait(proc, f"{url}/mlflow/health", self.token, started)
            with urllib.request.urlopen(f"{url}/api/v1/health", timeout=10) as answer:
                own = json.loads(answer.read()).get("mlflow", {}).get("ready_after_s")
        finally:
            _stop(proc)
        return {"ready_s": ready_s, "cpu_s": own_cpu_s + mlflow_cpu_s, "mlflow_cpu_s": mlflow_cpu_s,
                "server_says_s": own, "load": load}

    @property
    def store(self) -> str:
        return f"sqlite:///{self.home / 'mlflow.db'}"


def peer_once(store: str, artifacts: Path, workers: int | None) -> dict[str, Any]:
    port = free_port()
    argv = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", store, "--default-artifact-root",
            artifacts.as_uri(), "--host", "127.0.0.1", "--port", str(port)]
    if workers is not None:
        argv += ["--workers", str(workers)]
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    load = os.getloadavg()[0]
    started = time.monotonic()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        ready_s, cli_cpu_s, workers_cpu_s = _wait(proc, f"http://127.0.0.1:{port}/health", None, started)
    finally:
        _stop(proc)
    return {"ready_s": ready_s, "cpu_s": cli_cpu_s + workers_cpu_s, "load": load}


def summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    return {key: round(statistics.median(float(r[key]) for r in rows), 2)
            for key in rows[0] if all(isinstance(r[key], (int, float)) for r in rows)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--no-peer", action="store_true", help="only `air server start`")
    parser.add_argument("--json", action="store_true", help="print every rep as JSON too")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="air-bench-mlflow-") as work:
        air = AirStart(Path(work) / "home")
        first = air.once()  # makes the store: untimed in the medians
        print(f"first start on a fresh AIR_HOME (makes the store): {first['ready_s']:.1f} s, "
              f"CPU {first['cpu_s']:.1f} s, load {first['load']:.1f}", flush=True)
        rows: dict[str, list[dict[str, Any]]] = {"air": [], "peer": [], "peer_1": []}
        for rep in range(args.reps):
            rows["air"].append(air.once())
            if not args.no_peer:
                rows["peer"].append(peer_once(air.store, Path(work) / "peer-artifacts", None))
                rows["peer_1"].append(peer_once(air.store, Path(work) / "peer-artifacts", 1))
            print(f"rep {rep + 1}: " + "  ".join(f"{k} {v[-1]['ready_s']:.1f} s (CPU {v[-1]['cpu_s']:.1f} s, "
                                                   f"load {v[-1]['load']:.1f})" for k, v in rows.items() if v),
                  flush=True)
        labels = {"air": "air server start -> MLflow through the door", "peer": "mlflow server (4 workers)",
                  "peer_1": "mlflow server --workers 1"}
        found = {k: summary(v) for k, v in rows.items() if v}
        print(f"\nmedian of {args.reps} on {os.cpu_count()} CPUs:")
        for key, med in found.items():
            print(f"  {labels[key]:45s} ready {med['ready_s']:6.1f} s  CPU {med['cpu_s']:5.1f} s  load {med['load']:.1f}"
                  + (f"  (MLflow's processes: CPU {med['mlflow_cpu_s']:.1f} s; the server says ready after "
                     f"{med['server_says_s']} s)" if "server_says_s" in med else ""))
        if "peer" in found:
            for key in ("peer", "peer_1"):
                print(f"  air / {labels[key]}: ready x{found['air']['ready_s'] / found[key]['ready_s']:.2f}, "
                      f"CPU x{found['air']['cpu_s'] / found[key]['cpu_s']:.2f}")
        if args.json:
            print(json.dumps({"first": first, "reps": rows, "medians": found}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
