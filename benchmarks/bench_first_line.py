"""A run submitted the moment `air server start` answers: seconds from its submit to its first node line
in `air run --watch`, while the server's MLflow is still starting (issue 35: ≤ 15 s at load ≥ 8), beside
the same run on a server whose MLflow is ready (the ratio says what the cold start still costs a run).

    .venv/bin/python benchmarks/bench_first_line.py [--reps 5] [--hogs 8]

* cold: a fresh `air server start` (MLflow on) on a store made by an untimed first start; as soon as
  `/api/v1/health` answers, `air run -f wl.yaml --watch` as a user; timed from that command's start to the
  line the node prints first.
* warm: the same submit to the same server once its MLflow answers.
* `--hogs N`: N busy processes (a test-made CPU hog) run the whole time, so the machine's load is ≥ N;
  the 1-minute load is printed beside each median.
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parent))
import argparse
import json
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from server_proc import AIR, free_port

MARKER = "first-node-line"
WORKLOAD = f"""\
experiment_name: bench-first-line
compute: {{accelerator_type: CPU_1xCPU, num_accelerators: 1}}
command: echo {MARKER}
"""


def _hog() -> None:
    while True:
        pass


def _health(url: str) -> dict[str, object] | None:
    try:
        with urllib.request.urlopen(url + "/api/v1/health", timeout=2) as answer:
            return dict(json.loads(answer.read()))
    except OSError:
        return None


def _first_line_s(env: dict[str, str], spec: Path) -> float:
    """`air run --watch` from its start to the node's first line (the run is then left to finish)."""
    started = time.monotonic()
    proc = subprocess.Popen([*AIR, "run", "-f", str(spec), "--watch"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    seen = None
    for line in proc.stdout:
        if seen is None and MARKER in line and "echo" not in line:
            seen = time.monotonic() - started
    proc.wait()
    if seen is None:
        raise RuntimeError(f"the node's line never came (exit {proc.returncode})")
    return seen


class Server:
    def __init__(self, home: Path) -> None:
        home.mkdir(parents=True, exist_ok=True)
        base = {k: v for k, v in os.environ.items() if k not in ("AIR_SERVER_URL", "AIR_TOKEN", "MLFLOW_TRACKING_URI")}
        self.env = {**base, "AIR_HOME": str(home)}
        self.token = subprocess.run([*AIR, "server", "token", "create", "bench", "--admin"], env=self.env,
                                    check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        self.client_home = home.parent / "client"

    def start(self) -> tuple[subprocess.Popen[bytes], dict[str, str], str]:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen([*AIR, "server", "start", "--port", str(port), "--mlflow-port", str(free_port())],
                                env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        while _health(url) is None:
            if proc.poll() is not None:
                raise RuntimeError(f"air server exited with {proc.returncode}")
            time.sleep(0.05)
        client = {**self.env, "AIR_HOME": str(self.client_home), "AIR_SERVER_URL": url, "AIR_TOKEN": self.token}
        return proc, client, url


def _stop(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--hogs", type=int, default=8, help="busy processes beside it (0: a quiet machine)")
    args = parser.parse_args()
    hogs = [multiprocessing.Process(target=_hog, daemon=True) for _ in range(args.hogs)]
    for hog in hogs:
        hog.start()
    rows: dict[str, list[float]] = {"cold": [], "warm": []}
    loads: list[float] = []
    try:
        with tempfile.TemporaryDirectory(prefix="air-bench-first-line-") as work:
            spec = Path(work) / "wl.yaml"
            spec.write_text(WORKLOAD)
            server = Server(Path(work) / "home")
            proc, client, url = server.start()  # makes the store and MLflow's: untimed
            _first_line_s(client, spec)
            _stop(proc)
            for rep in range(args.reps):
                proc, client, url = server.start()
                try:
                    loads.append(os.getloadavg()[0])
                    rows["cold"].append(_first_line_s(client, spec))
                    mlflow_state = (_health(url) or {}).get("mlflow")
                    while (_health(url) or {}).get("mlflow", {}).get("state") not in ("ready", "off"):  # type: ignore[union-attr]
                        time.sleep(0.2)
                    rows["warm"].append(_first_line_s(client, spec))
                finally:
                    _stop(proc)
                print(f"rep {rep + 1}: cold {rows['cold'][-1]:.1f} s (MLflow then: {mlflow_state}), "
                      f"warm {rows['warm'][-1]:.1f} s, load {loads[-1]:.1f}", flush=True)
    finally:
        for hog in hogs:
            hog.kill()
    cold, warm = statistics.median(rows["cold"]), statistics.median(rows["warm"])
    print(f"\nmedian of {args.reps} on {os.cpu_count()} CPUs, {args.hogs} busy processes, load median "
          f"{statistics.median(loads):.1f}:")
    print(f"  submitted as the server answers -> first node line  {cold:6.1f} s   (goal <= 15 s)")
    print(f"  submitted once MLflow is ready  -> first node line  {warm:6.1f} s")
    print(f"  cold / warm: x{cold / warm:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
