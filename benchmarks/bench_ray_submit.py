"""Submit-to-running latency on a warm Ray cluster: air's RayBackend beside `ray job submit`.

What is timed: from the moment of submission until *every* node runs the user's command (the command's
first act is to write the wall-clock time to a file). For air that is acquire (placement group, one
agent actor per node) + start; for Ray Jobs it is the job submission until the entrypoint runs
(one node only: Ray Jobs has no notion of per-node commands), both through the Python SDK (warm,
in-process, like air's backend) and through the `ray job submit` CLI (what a user types).

    python benchmarks/bench_ray_submit.py                 # starts a 2-node cluster of its own, stops it
    python benchmarks/bench_ray_submit.py --reps 10 --nodes 2 --address HOST:PORT --dashboard http://HOST:8265

Then, with --remote-call, a whole `@distributed(remote=True)` call of the trivial 2-rank-per-node gloo DDP
job of bench_launch.py on that cluster, with the nodes' ranks forked from one zygote each (the default)
and started cold (AIR_WARM_START=0), interleaved.

Prints the medians (and min/max) in seconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from timing import wait_file


def bench_air(address: str, nodes: int, reps: int, work: Path) -> list[float]:
    from air.accelerators import cpu_type
    from air.backends.base import NodeLaunch
    from air.backends.ray_backend import RayBackend

    backend = RayBackend(address, poll_wait_s=0.2)
    backend.connect()
    times = []
    for rep in range(reps + 1):  # the first one warms Ray's worker pool and imports; not counted
        run_id = f"run-260101-{uuid.uuid4().hex[:8]}"
        marks = work / f"air-{rep}"
        marks.mkdir()
        launches = [NodeLaunch.command(n, ["bash", "-c", f'date +%s.%N > {marks}/node_$NODE_RANK'],
                                       {"NODE_RANK": str(n)}, work / f"air-{rep}-node_{n}.log") for n in range(nodes)]
        submitted = time.time()
        allocation = backend.acquire(run_id, cpu_type(1), nodes, should_stop=lambda: False, on_wait=lambda _: None)
        assert allocation is not None
        handle = backend.start(allocation, launches, tag=f"air-{run_id}")
        started = max(wait_file(marks / f"node_{n}") for n in range(nodes))
        outcome = handle.wait(timeout_s=60, should_stop=lambda: False)
        backend.release(allocation)
        assert outcome.ok, outcome
        if rep:
            times.append(started - submitted)
    return times


def bench_job_sdk(dashboard: str, reps: int, work: Path) -> list[float]:
    from ray.job_submission import JobStatus, JobSubmissionClient

    client = JobSubmissionClient(dashboard)
    times = []
    for rep in range(reps + 1):
        mark = work / f"job-{rep}"
        submitted = time.time()
        job = client.submit_job(entrypoint=f"bash -c 'date +%s.%N > {mark}'")
        started = wait_file(mark)
        deadline = time.monotonic() + 60
        while client.get_job_status(job) not in (JobStatus.SUCCEEDED, JobStatus.FAILED) and time.monotonic() < deadline:
            time.sleep(0.05)
        if rep:
            times.append(started - submitted)
    return times


def bench_job_cli(dashboard: str, reps: int, work: Path) -> list[float]:
    ray_cli = str(Path(sys.executable).with_name("ray"))
    times = []
    for rep in range(reps + 1):
        mark = work / f"cli-{rep}"
        submitted = time.time()
        subprocess.run([ray_cli, "job", "submit", "--address", dashboard, "--no-wait", "--",
                        "bash", "-c", f"date +%s.%N > {mark}"], check=True, capture_output=True)
        started = wait_file(mark)
        if rep:
            times.append(started - submitted)
    return times


def bench_remote_call(address: str, nodes: int, reps: int, work: Path) -> dict[str, list[float]]:
    """End-to-end remote=True calls (allocation, code shipping, both nodes' ranks, results back)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import trivial_ddp

    from air import distributed

    home = work / "air-home"
    home.mkdir()
    (home / "config.yaml").write_text(
        f"default_profile: bench\nprofiles:\n  bench: {{backend: ray, address: '{address}'}}\n")
    os.environ.update(AIR_HOME=str(home), AIR_TRACKING="off")
    call = distributed(num_accelerators=2 * nodes, accelerator_type="CPU", remote=True)(trivial_ddp.job)
    times: dict[str, list[float]] = {"warm": [], "cold": []}
    for rep in range(reps + 1):  # the first round warms Ray's worker pool and the page cache
        for mode, setting in (("warm", "1"), ("cold", "0")):
            os.environ["AIR_WARM_START"] = setting
            start = time.perf_counter()
            assert call.distributed() == [2.0 * nodes] * (2 * nodes)
            if rep:
                times[mode].append(time.perf_counter() - start)
    os.environ.pop("AIR_WARM_START", None)
    return times


def _summary(name: str, values: list[float]) -> str:
    return (f"{name:<44} median {statistics.median(values):6.3f} s   min {min(values):6.3f}   "
            f"max {max(values):6.3f}   (n={len(values)})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--address", help="GCS address of an existing cluster (default: start one)")
    parser.add_argument("--dashboard", help="dashboard URL of that cluster, for Ray Jobs")
    parser.add_argument("--remote-call", action="store_true",
                        help="also time whole remote=True calls of a DDP job, warm vs cold rank start")
    parser.add_argument("--only-remote-call", action="store_true", help="skip the submit-latency part")
    args = parser.parse_args()
    from air.backends.ray_cluster import RayAuth, start_ray_node, use_auth

    started = []
    address, dashboard = args.address, args.dashboard
    if address is None:
        auth = RayAuth.new_token()
        head = start_ray_node(head=True, num_cpus=2, object_store_memory=100 * 1024 * 1024, auth=auth,
                              include_dashboard=True)
        started.append(head)
        for _ in range(args.nodes - 1):
            started.append(start_ray_node(head=False, address=head.address, num_cpus=2, auth=auth,
                                          object_store_memory=100 * 1024 * 1024))
        address, dashboard = head.address, head.dashboard_url
        use_auth(auth)
        time.sleep(5)  # let the dashboard and agents settle
    try:
        with tempfile.TemporaryDirectory(prefix="air-bench-") as tmp:
            work = Path(tmp)
            print(f"cluster {address}, {args.nodes} node(s), {args.reps} reps (+1 warm-up each), "
                  f"{os.cpu_count()} CPUs on this machine", flush=True)
            if args.remote_call or args.only_remote_call:
                remote = bench_remote_call(address, args.nodes, args.reps, work)
                print(_summary("remote=True DDP call, ranks forked (default)", remote["warm"]), flush=True)
                print(_summary("remote=True DDP call, AIR_WARM_START=0", remote["cold"]), flush=True)
                if args.only_remote_call:
                    return 0
            air_times = bench_air(address, args.nodes, args.reps, work)
            print(_summary(f"air RayBackend, all {args.nodes} nodes running", air_times), flush=True)
            if dashboard:
                print(_summary("Ray Jobs SDK submit_job, entrypoint running", bench_job_sdk(dashboard, args.reps, work)),
                      flush=True)
                print(_summary("`ray job submit` CLI, entrypoint running", bench_job_cli(dashboard, args.reps, work)),
                      flush=True)
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        for node in reversed(started):
            node.stop(grace_s=2.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
