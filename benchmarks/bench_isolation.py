"""What walls between users cost (issue 22): one server isolating its runs (`unix-user+bwrap` as root,
else `bwrap`) and one started with `--single-trust-domain` (no walls), on this machine, interleaved.

    .venv/bin/python benchmarks/bench_isolation.py [--reps 5]

* submit → running: from starting `air run -f wl.yaml --json` (a fresh CLI process) until the node's
  command has written its first line (its clock, `date +%s.%N`, read from the node log on the server).
* warm remote call: one caller process makes a `@distributed(remote=True)` call through the server once
  (not counted), then --reps more; each is timed from the call to its value.

Prints the medians of each and the ratio isolated / not isolated.
"""

from __future__ import annotations

import argparse
import json
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


class Server(BenchServer):
    def __init__(self, home: Path, *args: str) -> None:
        super().__init__(home, *args, admin=False, ready_s=120)
        self.isolation = self.health.get("isolation")


def _first_line_time(log: Path, timeout: float = 180.0) -> float:
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


def submit_once(server: Server, spec: Path) -> float:
    started = time.time()
    out = subprocess.run([*AIR, "run", "-f", str(spec), "--json"], env=server.client_env, check=True,
                         capture_output=True, text=True).stdout
    run_id = json.loads(out)["data"]["run_id"]
    return _first_line_time(server.home / "runs" / run_id / "attempt_0" / "node_0.log") - started


def warm_calls(server: Server, work: Path, reps: int) -> list[float]:
    script = work / "caller.py"
    script.write_text(CALLER)
    out = subprocess.run([sys.executable, str(script), str(reps)], env=server.client_env, cwd=work, check=True,
                         capture_output=True, text=True, timeout=900).stdout
    return [float(t) for t in json.loads(next(ln for ln in out.splitlines() if ln.startswith("TIMES "))[6:])]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="air-bench-isolation-") as tmp:
        work = Path(tmp)
        spec = work / "wl.yaml"
        spec.write_text("experiment_name: bench\ncompute: {accelerator_type: CPU_1xCPU, num_accelerators: 1}\n"
                        "command: date +%s.%N\n")
        servers = {"isolated": Server(work / "isolated"), "single trust domain": Server(work / "open",
                                                                                         "--single-trust-domain")}
        try:
            submit: dict[str, list[float]] = {label: [] for label in servers}
            for rep in range(args.reps + 1):  # interleaved; the first round is a warm-up
                for label, server in servers.items():
                    took = submit_once(server, spec)
                    if rep:
                        submit[label].append(took)
            calls = {label: warm_calls(server, work, args.reps) for label, server in servers.items()}
        finally:
            for server in servers.values():
                server.stop()
    print(f"isolation in force: {servers['isolated'].isolation!r} vs {servers['single trust domain'].isolation!r}")
    for name, data in (("submit -> RUNNING (first line)", submit), ("warm remote=True call", calls)):
        iso, plain = statistics.median(data["isolated"]), statistics.median(data["single trust domain"])
        print(f"{name}: isolated {iso:.3f} s ({min(data['isolated']):.3f}-{max(data['isolated']):.3f}), "
              f"no isolation {plain:.3f} s ({min(data['single trust domain']):.3f}-"
              f"{max(data['single trust domain']):.3f}), ratio {iso / plain:.2f}x")


if __name__ == "__main__":
    main()
