"""What walls between users cost (issues 22 and 34): one server isolating its runs (`unix-user+bwrap` as
root, else `bwrap`) and one started with `--single-trust-domain` (no walls), on this machine, interleaved,
both with their MLflow (the default `air server start`: nodes log through its door).

    .venv/bin/python benchmarks/bench_isolation.py [--reps 5] [--calls]

* submit → done: a 1-second run (`date +%s.%N; sleep 1`), from starting `air run -f wl.yaml --json` (a
  fresh CLI process) until the API says the run ended (polled every 50 ms); it must end SUCCESS.
* submit → first line, of the same runs: until the node's command wrote its first line (its clock,
  read from the node log on the server). The rest of submit → done is the second and the run's end.
* with --calls, a warm remote call: one caller process makes a `@distributed(remote=True)` call through
  the server once (not counted), then --reps more; each is timed from the call to its value.

Prints the medians (and ranges) of each and the ratio isolated / not isolated.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from server_proc import AIR, BenchServer

CALLER = textwrap.dedent("""
    import json, sys, time
    from air import distributed

    @distributed(num_accelerators=1, accelerator_type="CPU_1xCPU", remote=True)
    def one():
        return 1

    times = []
    for i in range(int(sys.argv[1]) + 1):
        started = time.perf_counter()
        assert one.distributed() == [1]
        if i:
            times.append(time.perf_counter() - started)
    print("TIMES " + json.dumps(times))
""")

#: What the API says of a run that ended (air.store.states.RunStatus's terminal values).
ENDED = {"SUCCESS", "FAILED", "CANCELED", "PREEMPTED", "LOST"}


class Server(BenchServer):
    def __init__(self, home: Path, *args: str) -> None:
        super().__init__(home, *args, admin=False, mlflow=True, ready_s=600)
        self.isolation = self.health.get("isolation")


def _first_line_time(log: Path, timeout: float = 300.0) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            for line in log.read_text().splitlines():
                try:
                    return float(line.strip())
                except ValueError:
                    continue
        except FileNotFoundError:
            pass
        time.sleep(0.005)
    raise TimeoutError(f"{log} never got its first line")


def _ended(server: Server, run_id: str, timeout: float = 300.0) -> tuple[float, str]:
    """When the API first says the run ended (this machine's clock), and its status."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = str(server.request("GET", f"/runs/{run_id}")["status"])
        if status in ENDED:
            return time.time(), status
        time.sleep(0.05)
    raise TimeoutError(f"run {run_id} did not end within {timeout:g} s")


def supervisors_done(server: Server, timeout: float = 600.0) -> None:
    """Wait until the server's supervisors ended (each ends its attempt's MLflow run after the run's end
    state, through the server): a server stopped before leaves them waiting for its MLflow."""
    import psutil

    def left() -> list[int]:
        found = []
        for proc in psutil.process_iter(["pid", "cmdline"]):
            try:
                if ("air.runs.supervisor" in (proc.info["cmdline"] or []) and proc.status() != psutil.STATUS_ZOMBIE
                        and proc.environ().get("AIR_HOME") == str(server.home)):
                    found.append(proc.pid)
            except (psutil.Error, OSError):
                continue
        return found

    deadline = time.monotonic() + timeout
    while left() and time.monotonic() < deadline:
        time.sleep(0.5)


def submit_once(server: Server, spec: Path) -> tuple[float, float]:
    """(submit → first line, submit → done) of one 1-second run."""
    started = time.time()
    out = subprocess.run([*AIR, "run", "-f", str(spec), "--json"], env=server.client_env, check=True,
                         capture_output=True, text=True).stdout
    run_id = json.loads(out)["data"]["run_id"]
    done, status = _ended(server, run_id)
    if status != "SUCCESS":
        raise RuntimeError(f"run {run_id} ended {status}, not SUCCESS")
    first = _first_line_time(server.home / "runs" / run_id / "attempt_0" / "node_0.log")
    return first - started, done - started


def warm_calls(server: Server, work: Path, reps: int) -> list[float]:
    script = work / "caller.py"
    script.write_text(CALLER)
    out = subprocess.run([sys.executable, str(script), str(reps)], env=server.client_env, cwd=work, check=True,
                         capture_output=True, text=True, timeout=900).stdout
    return [float(t) for t in json.loads(next(ln for ln in out.splitlines() if ln.startswith("TIMES "))[6:])]


def _line(name: str, data: dict[str, list[float]]) -> str:
    iso, plain = data["isolated"], data["single trust domain"]
    return (f"{name}: isolated {statistics.median(iso):.3f} s ({min(iso):.3f}-{max(iso):.3f}), no isolation "
            f"{statistics.median(plain):.3f} s ({min(plain):.3f}-{max(plain):.3f}), ratio "
            f"{statistics.median(iso) / statistics.median(plain):.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--calls", action="store_true", help="also time warm remote=True calls")
    args = parser.parse_args()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    with tempfile.TemporaryDirectory(prefix="air-bench-isolation-") as tmp:
        work = Path(tmp)
        os.chmod(work, 0o755)  # (an isolated run's account reaches its code through the view, not this path)
        spec = work / "wl.yaml"
        spec.write_text("experiment_name: bench\ncompute: {accelerator_type: CPU_1xCPU, num_accelerators: 1}\n"
                        "command: date +%s.%N; sleep 1\n")
        servers = {"isolated": Server(work / "isolated"),
                   "single trust domain": Server(work / "open", "--single-trust-domain")}
        try:
            first: dict[str, list[float]] = {label: [] for label in servers}
            done: dict[str, list[float]] = {label: [] for label in servers}
            for rep in range(args.reps + 1):  # interleaved; the first round is a warm-up
                for label, server in servers.items():
                    to_first, to_done = submit_once(server, spec)
                    if rep:
                        first[label].append(to_first)
                        done[label].append(to_done)
            calls = {label: warm_calls(server, work, args.reps) for label, server in servers.items()} \
                if args.calls else None
        finally:
            for server in servers.values():
                supervisors_done(server)
                server.stop()
    print(f"isolation in force: {servers['isolated'].isolation!r} vs {servers['single trust domain'].isolation!r}")
    print(_line("submit -> done (1-second run)", done))
    print(_line("submit -> node's first line", first))
    if calls is not None:
        print(_line("warm remote=True call", calls))
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
