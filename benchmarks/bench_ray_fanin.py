"""Log fan-in on Ray (issue 25): one submitting side (what a run's supervisor runs, `RayAttempt.wait`)
following many node agents, each node printing 10 lines a second.

Starts a Ray cluster of its own (head + workers, token authentication set explicitly), places `--agents`
node agents round-robin on its nodes (the real `NodeAgent`, as a run's nodes get them, but pinned to a
node rather than gang-placed, so 32 agents fit a few Ray nodes), starts one printer per agent and follows
them all from this process with the real `RayAttempt` at the default long-poll. Measures, in windows of
`--window` seconds: this process's CPU (cores; Ray's driver threads included), calls to the agents per
second, and at the end lines received against lines printed (each node's log checked line by line, in
order). Then a forced overflow: one node printing `--flood` lines as fast as it can while the submitting
side is held up (its line callback blocks until the printer ended), so the agent's buffer overflows and
the dropped count shows, with received + dropped = printed.

    python benchmarks/bench_ray_fanin.py                      # 32 agents on 4 Ray nodes, 30 s
    python benchmarks/bench_ray_fanin.py --agents 8 --seconds 10 --nodes 2

Prints medians over the windows. Stops only the Ray nodes it started.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

PRINTER = """
import sys, time
rank, seconds = sys.argv[1], int(sys.argv[2])
start = time.monotonic()
for i in range(10 * seconds):
    print(f"n{rank} line {i}", flush=True)
    time.sleep(max(start + (i + 1) / 10 - time.monotonic(), 0))
"""


def cpu_s() -> float:
    times = os.times()
    return times.user + times.system


def make_attempt(ray: Any, agents: list[Any], launches: list[Any], tag: str, on_line: Any) -> Any:
    from air.accelerators import cpu_type
    from air.backends.base import Allocation
    from air.backends.ray_attempt import Held, RayAttempt
    from air.constants import POLL_WAIT_S

    infos = ray.get([a.info.remote() for a in agents], timeout=300)
    allocation = Allocation(run_id=tag, accelerator=cpu_type(1), num_nodes=len(agents),
                            slots_per_node=tuple(("0",) for _ in agents))
    return RayAttempt(allocation, Held(pg=None, agents=agents, infos=infos, bundle={}), launches, tag=tag,
                      on_line=on_line, poll_wait_s=POLL_WAIT_S, master_addr="127.0.0.1", master_port=0)


def spawn_agents(ray: Any, count: int, prefix: str) -> list[Any]:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from air.backends.ray_agent import NodeAgent

    nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
    cls = ray.remote(NodeAgent)
    return [cls.options(num_cpus=0, max_concurrency=16, max_restarts=0,
                        scheduling_strategy=NodeAffinitySchedulingStrategy(nodes[i % len(nodes)], soft=False))
            .remote(prefix, i) for i in range(count)]


def steady(ray: Any, agents: list[Any], seconds: int, window: float, work: Path) -> dict[str, Any]:
    from air.backends.base import NodeLaunch

    tag = f"run-260101-{uuid.uuid4().hex[:8]}"
    launches = [NodeLaunch.command(n, [sys.executable, "-c", PRINTER, str(n), str(seconds)], {},
                                   work / f"steady-node_{n}.log") for n in range(len(agents))]
    received = [0]

    def on_line(_node: int, _index: int, _stream: str, _text: str) -> None:
        received[0] += 1

    attempt = make_attempt(ray, agents, launches, tag, on_line)
    specs = [[launch.processes[0]] for launch in launches]
    ray.get([a.start.remote(s, tag) for a, s in zip(agents, specs, strict=True)], timeout=300)
    samples: list[tuple[float, float, int]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(window):
            samples.append((time.monotonic(), cpu_s(), attempt.polls))

    samples.append((time.monotonic(), cpu_s(), attempt.polls))
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    outcome = attempt.wait(timeout_s=seconds + 300, should_stop=lambda: False)
    done.set()
    sampler.join()
    samples.append((time.monotonic(), cpu_s(), attempt.polls))
    assert outcome.ok, outcome
    cores, rpcs = [], []
    for (t0, c0, p0), (t1, c1, p1) in zip(samples, samples[1:], strict=False):
        if t1 - t0 >= window / 2:
            cores.append((c1 - c0) / (t1 - t0))
            rpcs.append((p1 - p0) / (t1 - t0))
    in_order = all(
        launch.log_path.read_text().splitlines() == [f"n{n} line {i}" for i in range(10 * seconds)]
        for n, launch in enumerate(launches))
    wall = samples[-1][0] - samples[0][0]
    return {"cores": cores, "rpcs": rpcs, "printed": 10 * seconds * len(agents), "received": received[0],
            "in_order": in_order, "wall": wall, "polls": attempt.polls,
            "cpu_total": samples[-1][1] - samples[0][1]}


def overflow(ray: Any, agent: Any, flood: int, work: Path) -> dict[str, Any]:
    from air.backends.base import NodeLaunch
    from air.backends.ray_agent import tagged_processes_any_node

    tag = f"run-260101-{uuid.uuid4().hex[:8]}"
    launch = NodeLaunch.command(0, ["seq", "1", str(flood)], {}, work / "flood-node_0.log")
    blocked = threading.Event()

    def slow(_node: int, _index: int, _stream: str, _text: str) -> None:
        if not blocked.is_set():  # the submitting side falls behind: held until the printer ended
            blocked.set()
            deadline = time.monotonic() + 300
            while tagged_processes_any_node(tag) and time.monotonic() < deadline:
                time.sleep(0.2)

    attempt = make_attempt(ray, [agent], [launch], tag, slow)
    ray.get(agent.start.remote([launch.processes[0]], tag), timeout=300)
    outcome = attempt.wait(timeout_s=600, should_stop=lambda: False)
    assert outcome.ok, outcome
    lines = launch.log_path.read_text().splitlines()
    notes = [line for line in lines if line.startswith("[air] ")]
    return {"printed": flood, "received": len(lines) - len(notes), "dropped": attempt.dropped().get(0, 0),
            "note": notes[0] if notes else "(no note)"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=32)
    parser.add_argument("--nodes", type=int, default=4, help="Ray nodes of the cluster started here")
    parser.add_argument("--seconds", type=int, default=30)
    parser.add_argument("--window", type=float, default=5.0)
    parser.add_argument("--flood", type=int, default=600_000, help="lines the overflowing node prints")
    args = parser.parse_args()

    import ray

    from air.backends.ray_cluster import RayAuth, start_ray_node, use_auth

    auth = RayAuth.new_token()  # token authentication, set explicitly (as tests/conftest.py does)
    nodes = []
    try:
        head = start_ray_node(head=True, num_cpus=2, object_store_memory=100 * 1024 * 1024, auth=auth)
        nodes.append(head)
        for _ in range(args.nodes - 1):
            nodes.append(start_ray_node(head=False, address=head.address, num_cpus=2, auth=auth,
                                        object_store_memory=100 * 1024 * 1024))
        use_auth(auth)
        ray.init(address=head.address, namespace="air-bench", log_to_driver=False)
        prefix = f"bench-fanin-{uuid.uuid4().hex[:6]}"
        agents = spawn_agents(ray, args.agents, prefix)
        with tempfile.TemporaryDirectory(prefix="air-bench-fanin-") as tmp:
            work = Path(tmp)
            result = steady(ray, agents, args.seconds, args.window, work)
            flood = overflow(ray, agents[0], args.flood, work)
        ray.get([a.cleanup.remote() for a in agents], timeout=120)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        for node in reversed(nodes):
            node.stop(grace_s=2.0)

    per_node = statistics.median(result["rpcs"]) / args.agents
    print(f"{args.agents} agents on {args.nodes} Ray nodes, 10 lines/s each for {args.seconds} s "
          f"(wall {result['wall']:.1f} s, windows of {args.window:g} s):")
    print(f"  submitting side CPU: median {statistics.median(result['cores']):.3f} cores "
          f"(min {min(result['cores']):.3f}, max {max(result['cores']):.3f}; "
          f"{result['cpu_total']:.1f} CPU-s in all)")
    print(f"  calls to agents: median {statistics.median(result['rpcs']):.1f}/s ({per_node:.2f}/s per node; "
          f"{result['polls']} in all)")
    print(f"  lines: printed {result['printed']:,}, received {result['received']:,}, "
          f"node logs complete and in order: {result['in_order']}")
    print(f"forced overflow: printed {flood['printed']:,}, received {flood['received']:,}, "
          f"dropped (counted) {flood['dropped']:,}; received + dropped = printed: "
          f"{flood['received'] + flood['dropped'] == flood['printed']}")
    print(f"  node log says: {flood['note'][:160]}")
    ok = result["received"] == result["printed"] and result["in_order"] and flood["dropped"] > 0 and \
        flood["received"] + flood["dropped"] == flood["printed"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
