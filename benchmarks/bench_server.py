"""`air server` benchmarks (issue 14): submit → RUNNING through the server vs the local CLI vs `ray job
submit`; `list runs` over 100,000 runs through the API; 50 clients following one run's logs at once.

    .venv/bin/python benchmarks/bench_server.py [--reps 5] [--runs 100000] [--followers 50] [--no-ray]

* submit → running: from starting the `air run -f wl.yaml` process (a fresh CLI process each time, as a
  user types it) until the node's command has written its first line (the wall-clock time, to a file).
  The same 1-node CPU workload through the server (AIR_SERVER_URL + AIR_TOKEN) and on this machine's
  own AIR_HOME; beside them `ray job submit --no-wait` against a fresh 1-node Ray cluster with its
  dashboard (Ray Jobs' entrypoint running), as benchmarks/bench_ray_submit.py measures it.
* list runs: `GET /api/v1/runs?all_users=1&all_status=1&limit=20` (and the default active-only listing)
  over a store filled with --runs runs (benchmarks/bench_store.py's fill), HTTP client in process;
  and `air list runs --all-users --all-status` as a whole process through the server.
* followers: one run prints a line carrying its write time every 50 ms for 15 s; --followers clients
  follow it through `GET /api/v1/runs/ID/follow` at once. Reports the delay from a line's write to
  each client's receipt (median, p95) and the server process's CPU over the run.

Medians over --reps, in seconds or milliseconds as labelled.
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
import threading
import time
from pathlib import Path

import psutil
from server_proc import AIR, BenchServer
from timing import wait_file


class Server(BenchServer):
    def __init__(self, home: Path) -> None:
        super().__init__(home, ready_s=120)

    def client(self) -> object:
        from air.client import ServerClient

        return ServerClient(self.url, self.token)


def _workload(folder: Path, mark: Path) -> Path:
    spec = folder / f"wl-{mark.name}.yaml"
    spec.write_text("experiment_name: bench\ncompute: {accelerator_type: CPU_1xCPU, num_accelerators: 1}\n"
                    f"command: date +%s.%N > {mark}\n")
    return spec


def bench_submit(envs: dict[str, dict[str, str]], work: Path, reps: int) -> dict[str, list[float]]:
    """Interleaved (server, local, server, …) so both see the same load; the first round is a warm-up."""
    times: dict[str, list[float]] = {label: [] for label in envs}
    for rep in range(reps + 1):
        for label, env in envs.items():
            mark = work / f"{label}-{rep}"
            spec = _workload(work, mark)
            started = time.time()
            subprocess.run([*AIR, "run", "-f", str(spec), "--json"], env=env, check=True, capture_output=True)
            ran = wait_file(mark)
            if rep:
                times[label].append(ran - started)
    return times


def bench_ray_job(work: Path, reps: int) -> list[float] | None:
    from bench_ray_submit import bench_job_cli

    from air.backends.ray_cluster import RayAuth, start_ray_node, use_auth

    auth = RayAuth.new_token()
    head = start_ray_node(head=True, num_cpus=2, object_store_memory=100 * 1024 * 1024, auth=auth,
                          include_dashboard=True)
    try:
        use_auth(auth)
        time.sleep(5)  # let the dashboard and its job agent settle
        return bench_job_cli(str(head.dashboard_url), reps, work)
    finally:
        head.stop(grace_s=2.0)


def bench_list(server: Server, reps: int) -> dict[str, list[float]]:
    client = server.client()
    out: dict[str, list[float]] = {"api_all": [], "api_active": [], "cli_all": []}
    for rep in range(reps + 1):
        t0 = time.perf_counter()
        rows = client.get("/runs", all_users=True, all_status=True, limit=20)["runs"]  # type: ignore[attr-defined]
        t1 = time.perf_counter()
        client.get("/runs", all_users=True)  # type: ignore[attr-defined]
        t2 = time.perf_counter()
        subprocess.run([*AIR, "list", "runs", "--all-users", "--all-status"], env=server.client_env, check=True,
                       capture_output=True)
        t3 = time.perf_counter()
        assert len(rows) == 20
        if rep:
            out["api_all"].append(t1 - t0)
            out["api_active"].append(t2 - t1)
            out["cli_all"].append(t3 - t2)
    return out


def bench_followers(server: Server, work: Path, followers: int) -> dict[str, float]:
    script = work / "ticker.py"
    script.write_text("import time\nfor i in range(300):\n    print(f'{time.time():.6f} {i}', flush=True)\n"
                      "    time.sleep(0.05)\n")
    spec = work / "ticker.yaml"
    spec.write_text("experiment_name: bench-follow\ncompute: {accelerator_type: CPU_1xCPU, num_accelerators: 1}\n"
                    f"command: {sys.executable} {script}\n")
    submitted = subprocess.run([*AIR, "run", "-f", str(spec), "--json"], env=server.client_env, check=True,
                               capture_output=True, text=True)
    run_id = json.loads(submitted.stdout)["data"]["run_id"]
    delays: list[float] = []
    lock = threading.Lock()
    counts: list[int] = []

    def follow() -> None:
        client = server.client()
        seen = 0
        for item in client.stream(f"/runs/{run_id}/follow"):  # type: ignore[attr-defined]
            now = time.time()
            for line in item.get("lines", []):
                with lock:
                    delays.append(now - float(line.split()[0]))
                seen += 1
        counts.append(seen)

    proc = psutil.Process(server.proc.pid)
    cpu0, wall0 = sum(proc.cpu_times()[:2]), time.monotonic()
    threads = [threading.Thread(target=follow) for _ in range(followers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    cpu1, wall1 = sum(proc.cpu_times()[:2]), time.monotonic()
    delays.sort()
    return {"clients": float(len(counts)), "lines_each": float(statistics.median(counts)),
            "delay_median_ms": statistics.median(delays) * 1000, "delay_p95_ms": delays[int(len(delays) * 0.95)] * 1000,
            "server_cpu_pct": (cpu1 - cpu0) / (wall1 - wall0) * 100, "seconds": wall1 - wall0}


def _summary(name: str, values: list[float], unit: str = "s") -> str:
    scale = 1000 if unit == "ms" else 1
    return (f"{name:<58} median {statistics.median(values) * scale:8.1f} {unit}   min {min(values) * scale:8.1f}   "
            f"max {max(values) * scale:8.1f}   (n={len(values)})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--runs", type=int, default=100_000)
    parser.add_argument("--followers", type=int, default=50)
    parser.add_argument("--no-ray", action="store_true", help="skip `ray job submit`")
    parser.add_argument("--only-submit", action="store_true", help="only the submit -> running part")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="air-bench-server-") as tmp:
        root = Path(tmp)
        server = Server(root / "server-home")
        try:
            work = root / "work"
            work.mkdir()
            print(f"{os.cpu_count()} CPUs, {args.reps} reps (+1 warm-up)", flush=True)
            submitted = bench_submit({"server": server.client_env,
                                      "local": {**os.environ, "AIR_HOME": str(root / "local-home")}}, work, args.reps)
            via, local = submitted["server"], submitted["local"]
            print(_summary("submit -> running, `air run` through air server", via), flush=True)
            print(_summary("submit -> running, `air run` on this machine", local), flush=True)
            if not args.no_ray:
                ray = bench_ray_job(work, args.reps)
                if ray:
                    print(_summary("submit -> running, `ray job submit --no-wait`", ray), flush=True)
            print(f"ratio server/local {statistics.median(via) / statistics.median(local):.2f}", flush=True)
            if args.only_submit:
                return 0
            result = bench_followers(server, work, args.followers)
            print(f"{int(result['clients'])} followers of one run for {result['seconds']:.1f} s: line delay median "
                  f"{result['delay_median_ms']:.0f} ms, p95 {result['delay_p95_ms']:.0f} ms; server CPU "
                  f"{result['server_cpu_pct']:.0f}% of one core; {result['lines_each']:.0f} lines each", flush=True)
            from bench_store import fill

            took, _ = fill(server.home, args.runs)
            print(f"filled {args.runs} runs in {took:.1f} s", flush=True)
            listed = bench_list(server, args.reps)
            print(_summary(f"GET /api/v1/runs, all users, all status, limit 20 ({args.runs} runs)",
                           listed["api_all"], "ms"), flush=True)
            print(_summary("GET /api/v1/runs, all users, active only", listed["api_active"], "ms"), flush=True)
            print(_summary("`air list runs --all-users --all-status` through the server", listed["cli_all"], "ms"),
                  flush=True)
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
