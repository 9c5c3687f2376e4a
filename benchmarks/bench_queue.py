"""Queued runs are rows (issue 25): 1,000 runs queued on a 1-slot pool through a real `air server`, and
`air list runs` over 5,000 queued rows.

    .venv/bin/python benchmarks/bench_queue.py [--depth 1000] [--chain 7] [--rows 5000] [--reps 5]

* tree: the server's process tree (and every process of its AIR_HOME) and their memory (RSS, MB) with one
  run holding the slot, before and after --depth more runs were queued behind it through `POST /api/v1/runs`.
  Behind the first in line (whose supervisor stands by to claim the slot) a queued run is a row: no process.
* slot freed -> next RUNNING: the holder is released; the next --chain runs (each `sleep --run-s`) run one
  after another with ~--depth runs still behind them (a run shorter than a supervisor's start-up, ~1 s here,
  shows that start-up: the next in line stands by only once the one before it has its slot). For each, the store's `ended_at` of the run before (its slot
  released in the same transaction) to its own `started_at` (RUNNING); median and max over the chain.
* list: `air list runs` as a whole process over a store of --rows QUEUED runs (inserted, no loop running),
  beside `air list runs` over an empty store (the start-up floor); medians over --reps.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
from server_proc import AIR, BenchServer


class Server(BenchServer):
    """One slot, tracking off, runs not walled in: the queue is what is measured."""

    def __init__(self, home: Path) -> None:
        super().__init__(home, "--single-trust-domain", env={"AIR_CPU_SLOTS": "1", "AIR_TRACKING": "off"})

    def submit(self, name: str, command: str) -> str:
        spec = {"experiment_name": name, "max_retries": 0, "command": command,
                "compute": {"num_accelerators": 1, "accelerator_type": "CPU_1xCPU"}}
        return str(self.request("POST", "/runs", {"spec": spec})["run_id"])

    def tree(self) -> tuple[int, float, int, float]:
        """(processes in the server's tree, their RSS MB; processes of its AIR_HOME, their RSS MB)."""
        root = psutil.Process(self.proc.pid)
        tree = [root, *root.children(recursive=True)]
        home = []
        for proc in psutil.process_iter():
            try:
                if proc.environ().get("AIR_HOME") == str(self.home) and proc.status() != psutil.STATUS_ZOMBIE:
                    home.append(proc)
            except (psutil.Error, OSError):
                continue

        def rss(procs: list[psutil.Process]) -> float:
            total = 0
            for proc in procs:
                try:
                    total += proc.memory_info().rss
                except psutil.Error:
                    continue
            return total / 1e6

        return len(tree), rss(tree), len(home), rss(home)


def _wait(predicate: Any, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def bench_server(work: Path, depth: int, chain: int, run_s: float) -> dict[str, Any]:
    home = work / "server-home"
    server = Server(home)
    os.environ["AIR_HOME"] = str(home)  # this process reads the server's store (timestamps) and cleans up
    from air.runs.cancel import cancel_run
    from air.store.states import RunStatus
    from air.store.run_store import RunStore

    store = RunStore()
    out: dict[str, Any] = {}
    try:
        marker = work / "release"
        holder = server.submit("holder", f"while [ ! -e {marker} ]; do sleep 0.05; done")
        _wait(lambda: store.get_run(holder).status is RunStatus.RUNNING, "the holder to run")
        first = server.submit("q", f"sleep {run_s}")
        _wait(lambda: store.get_run(first).supervisor_pid is not None, "the first in line to stand by")
        time.sleep(2)
        out["tree_before"] = server.tree()
        started = time.perf_counter()
        with ThreadPoolExecutor(8) as pool:
            ids = [first, *pool.map(lambda i: server.submit("q", f"sleep {run_s}"), range(depth - 1))]
        out["submit_s"] = time.perf_counter() - started
        time.sleep(3)  # the loop has passed over the whole queue
        out["tree_after"] = server.tree()
        out["queued"] = sum(1 for r in ids if store.get_run(r).status is RunStatus.QUEUED)
        out["supervised_queued"] = sum(1 for r in ids if store.get_run(r).supervisor_pid is not None)
        seq = dict(store.reader().execute("SELECT id, queue_seq FROM runs WHERE status = 'QUEUED'").fetchall())
        order = sorted(ids, key=lambda r: seq.get(r) or 0)
        marker.touch()
        prev = holder
        gaps = []
        for run_id in order[:chain]:
            _wait(lambda r=run_id: store.get_run(r).started_at is not None, f"{run_id} to start", timeout=120)
            _wait(lambda p=prev: store.get_run(p).ended_at is not None, f"{prev} to end", timeout=120)
            gaps.append((store.get_run(run_id).started_at or 0.0) - (store.get_run(prev).ended_at or 0.0))
            prev = run_id
        out["gaps"] = gaps
        out["depth_behind"] = sum(1 for r in ids if store.get_run(r).status is RunStatus.QUEUED)
        started = time.perf_counter()
        for run_id in [r for r in order[::-1] if not store.get_run(r).is_terminal]:
            cancel_run(store, run_id)
        out["cancel_s"] = time.perf_counter() - started
    finally:
        try:
            for active in store.list_runs(limit=None):
                cancel_run(store, active.id)
        finally:
            server.stop()
    return out


def bench_list(work: Path, rows: int, reps: int) -> dict[str, list[float]]:
    from air.store.records import Run
    from air.store.states import RunStatus
    from air.store.run_store import RunStore

    full, empty = work / "list-home", work / "empty-home"
    now = time.time()
    os.environ["AIR_HOME"] = str(full)
    RunStore().insert_runs(
        Run(id=f"run-000000-{i:08x}", experiment="bench", status=RunStatus.QUEUED, accelerator_type="CPU_1xCPU",
            num_accelerators=1, num_nodes=1, submitted_at=now - rows + i, backend="local", kind="workload",
            user="bench") for i in range(rows))
    times: dict[str, list[float]] = {"queued": [], "empty": [], "queued_cpu": [], "empty_cpu": []}
    for rep in range(reps + 1):
        for label, home in (("queued", full), ("empty", empty)):
            env = {**os.environ, "AIR_HOME": str(home)}
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            started = time.perf_counter()
            subprocess.run([*AIR, "list", "runs"], env=env, check=True, capture_output=True)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            if rep:  # the first round warms the page cache
                times[label].append(time.perf_counter() - started)
                times[label + "_cpu"].append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=1000)
    parser.add_argument("--chain", type=int, default=7)
    parser.add_argument("--rows", type=int, default=5000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--run-s", type=float, default=5.0,
                        help="how long each chained run lasts: the next supervisor starts up meanwhile")
    parser.add_argument("--skip-server", action="store_true")
    parser.add_argument("--work", help="keep the AIR_HOMEs here (default: a temporary folder, removed)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="air-bench-queue-") as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        listing = bench_list(work, args.rows, args.reps)
        med = {k: statistics.median(v) for k, v in listing.items()}
        print(f"air list runs, {args.rows} QUEUED rows: median {med['queued']:.3f} s wall, {med['queued_cpu']:.3f} s "
              f"CPU (empty store: {med['empty']:.3f} s wall, {med['empty_cpu']:.3f} s CPU), {args.reps} reps")
        if args.skip_server:
            return
        out = bench_server(work, args.depth, args.chain, args.run_s)
        for label in ("tree_before", "tree_after"):
            n, mb, hn, hmb = out[label]
            print(f"{label}: server tree {n} processes {mb:.0f} MB; AIR_HOME's processes {hn}, {hmb:.0f} MB")
        print(f"submitted {args.depth} runs through the API in {out['submit_s']:.1f} s; {out['queued']} QUEUED, "
              f"{out['supervised_queued']} of them with a supervisor")
        gaps = out["gaps"]
        print(f"slot freed -> next RUNNING at depth ~{args.depth}: median {statistics.median(gaps) * 1000:.0f} ms, "
              f"max {max(gaps) * 1000:.0f} ms over {len(gaps)} ({', '.join(f'{g * 1000:.0f}' for g in gaps)})")
        print(f"{out['depth_behind']} still queued after the chain; canceled all in {out['cancel_s']:.1f} s")


if __name__ == "__main__":
    main()
