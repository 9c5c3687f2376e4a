"""System metrics of a Ray workload sampled where each node runs (issue 24): each node's agent samples its
own host and ships the samples on its poll replies; the supervisor logs them, one batch per interval for
all nodes, labelled with the host and Ray node its agent really runs on."""

from __future__ import annotations

import os
import socket
import sys
import threading
from pathlib import Path

import pytest

from air.backends.ray_agent import tagged_processes_any_node
from air.errors import RayInitializationError
from air.store.paths import RunPaths, process_tag
from air.store.run_store import RunStore
from air.store.states import RunStatus
from proc_helpers import mlflow_run_ended, tracking_done, wait_for

pytestmark = pytest.mark.ray

AIR = [sys.executable, "-m", "air.cli.main"]
NODES = 8
METRICS = ("cpu_utilization_percentage", "system_memory_usage_megabytes", "system_memory_usage_percentage")


def _client(air_home: Path):
    import mlflow

    from air.tracking import prepare_store

    uri = f"sqlite:///{air_home / 'mlflow.db'}"
    prepare_store(uri)
    return mlflow.MlflowClient(uri)


def _add_nodes(ray_cluster, count: int) -> list:
    """`count` more 1-CPU Ray nodes (a STRICT_SPREAD run of NODES needs NODES Ray nodes), one after another:
    started at once, they overload the head's GCS on a small machine and time out."""
    added: list = []
    try:
        for _ in range(count):
            try:
                added.append(ray_cluster.add_node(num_cpus=1))
            except RayInitializationError:  # a loaded machine: once more, after the others settled
                added.append(ray_cluster.add_node(num_cpus=1))
    except BaseException:
        _remove_nodes(ray_cluster, added)
        raise
    return added


def _remove_nodes(ray_cluster, nodes: list) -> None:
    for node in nodes:
        node.stop(grace_s=1.0)
        if node in ray_cluster.nodes:
            ray_cluster.nodes.remove(node)


def _ray_node_ids(ray_cluster) -> dict[str, str]:
    """Each test-cluster node's marker -> its Ray node id (matched by the raylet's node-manager port)."""
    import ray

    if not ray.is_initialized():
        ray.init(address=ray_cluster.address, log_to_driver=False)
    by_port = {int(n["NodeManagerPort"]): n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    return {node.marker: by_port[node.ports["node-manager-port"]] for node in ray_cluster.nodes
            if node.ports.get("node-manager-port") in by_port}


def _agent_node(ray_cluster, agent_pid: int) -> str:
    """The marker of the test-cluster node whose processes include the agent `agent_pid`."""
    found = [node.marker for node in ray_cluster.nodes if any(p.pid == agent_pid for p in node.processes())]
    assert len(found) == 1, (agent_pid, found)
    return found[0]


@pytest.mark.timeout(900)  # 5 Ray nodes added, then its own waits (240 + 60 + 240 + 240 s): over the default 300 s
def test_8_agents_sample_their_own_hosts_no_stall_metrics_of_every_node(ray_cluster, air_home: Path,
                                                                        tmp_path: Path) -> None:
    ray_cluster.write_profile(air_home)
    have = len(_ray_node_ids(ray_cluster))
    added = _add_nodes(ray_cluster, max(0, NODES - have))
    import subprocess

    marks = tmp_path / "marks"
    marks.mkdir()
    # Each node says which agent started it, waits until the test has looked (so it runs while its agent
    # samples: several intervals of 2 s), then notes when it exits.
    yaml = tmp_path / "w.yaml"
    yaml.write_text(
        "experiment_name: ray-node-metrics\n"
        f"compute: {{num_accelerators: {NODES}, accelerator_type: CPU_1xCPU}}\n"
        "command: |\n"
        "  echo \"agent=$AIR_LAUNCHER_PID\"\n"
        f"  for _ in $(seq 1 3000); do [ -e {marks}/go ] && break; sleep 0.2; done\n"
        "  sleep 5\n"
        "  echo \"node $NODE_RANK done\"\n"
        f"  {sys.executable} -c 'import time; print(repr(time.time()))' > {marks}/exit_$NODE_RANK\n"
        "max_retries: 0\n")
    proc = subprocess.Popen([*AIR, "run", "-f", str(yaml)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "AIR_HOME": str(air_home)})
    try:
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, out
        run = wait_for(lambda: next(iter(RunStore().list_runs(statuses="all", limit=1)), None), "the run", timeout=60)
        paths = RunPaths(run.id)

        def agent_pids() -> dict[int, int] | None:
            pids = {}
            for n in range(NODES):
                log = paths.node_log(0, n)
                text = log.read_text() if log.exists() else ""
                line = next((x for x in text.splitlines() if x.startswith("agent=")), None)
                if line is None:
                    return None
                pids[n] = int(line.split("=", 1)[1])
            return pids

        pids = wait_for(agent_pids, "every node to start", timeout=240)
        markers = {n: _agent_node(ray_cluster, pid) for n, pid in pids.items()}  # the agents are alive now
        node_ids = _ray_node_ids(ray_cluster)
        (marks / "go").touch()
        run = wait_for(lambda: (r := RunStore().get_run(run.id)).status.is_terminal() and r, "the run's end",
                       timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
        _remove_nodes(ray_cluster, added)
    assert run.status is RunStatus.SUCCESS, run.termination_reason
    assert len(set(markers.values())) == NODES, markers  # STRICT_SPREAD: 8 agents on 8 Ray nodes
    last_exit = max(float((marks / f"exit_{n}").read_text()) for n in range(NODES))
    assert run.ended_at is not None
    assert run.ended_at - last_exit < 2.0, f"the attempt ended {run.ended_at - last_exit:.2f} s after its last node"
    assert not tagged_processes_any_node(process_tag(run.id))

    tracking_done(run.id)
    run = RunStore().get_run(run.id)
    client = _client(air_home)
    record = mlflow_run_ended(client, str(run.mlflow_run_id), air_run_id=run.id)
    metrics, tags = record.data.metrics, record.data.tags
    histories: dict[int, list[int]] = {}
    for n in range(NODES):
        for name in METRICS:
            assert f"system/node_{n}/{name}" in metrics, (n, name)
        # Labelled with where its agent ran: the host, and the Ray node the test found that agent on.
        assert tags[f"air.host.node_{n}"] == socket.gethostname(), n
        assert tags[f"air.ray_node_id.node_{n}"] == node_ids[markers[n]], n
        assert tags[f"air.ip.node_{n}"], n
        history = client.get_metric_history(str(run.mlflow_run_id), f"system/node_{n}/cpu_utilization_percentage")
        assert [m.step for m in sorted(history, key=lambda m: m.step)] == list(range(len(history))), n
        assert len(history) >= 2, (n, len(history))  # the node ran several sampling intervals
        histories[n] = sorted(m.timestamp for m in history)
    assert len({tags[f"air.ray_node_id.node_{n}"] for n in range(NODES)}) == NODES
    print(f"\n{NODES} agents on {len(set(markers.values()))} Ray nodes: end {run.ended_at - last_exit:.2f} s after "
          f"the last node's exit; samples per node {[len(h) for h in histories.values()]}")
    # Sampled by each agent on its own clock, not by one sampler of the supervisor's machine (which logs
    # every node's sample of a step at one timestamp): the nodes' sample times differ.
    assert len({tuple(h) for h in histories.values()}) > 1, histories
    for n in range(NODES):
        assert "[air] tracking" not in paths.node_log(0, n).read_text()
    warnings = [line for line in paths.supervisor_log.read_text().splitlines() if "tracking:" in line]
    assert len(warnings) == len(set(line.split(" ", 1)[1] for line in warnings)), warnings  # each at most once


def test_node_sampler_keeps_a_bounded_list_and_samples_once_more_at_stop() -> None:
    """The agent's sampler (no Ray needed): samples every interval into a bounded list, `take()` empties
    it, `stop()` adds a last sample and ends its thread."""
    from air.launcher.machine import NodeSampler

    sampler = NodeSampler([], interval_s=0.05, max_kept=3)
    sampler.start()
    try:
        wait_for(lambda: len(sampler._samples) == 3, "the list to fill", timeout=60)
        first = sampler.take()
        assert len(first) == 3 and not sampler._samples  # bounded, and taken
        assert all(set(metrics) == set(METRICS) for _, metrics in first), first
        assert [ts for ts, _ in first] == sorted(ts for ts, _ in first)
    finally:
        sampler.stop()
    assert sampler._thread is None and sampler.take(), "stop() takes a last sample"
    assert sampler.problems() == ""


def test_node_metrics_logger_logs_each_nodes_samples_at_its_times_tags_and_warns_once(air_home: Path) -> None:
    """The supervisor's side (no Ray needed): what nodes sampled is logged in one batch per interval with the
    nodes' own timestamps and per-node steps; each node's labels become its tags; a problem reported by
    several nodes is warned once; `stop()` logs what is still pending."""
    from air.launcher.machine import NodeSamples
    from air.tracking.attempt import start_attempt_run
    from air.tracking.sysmetrics import NodeMetricsLogger

    client = _client(air_home)
    handle = start_attempt_run("node-metrics-unit", None, {}, {})
    assert handle is not None
    uri = handle.tracking_uri
    arrivals: list[dict[int, NodeSamples]] = [
        {n: NodeSamples({"host": f"host-{n}", "ray_node_id": f"id-{n}", "ip": f"10.0.0.{n}"},
                        [(1_000 + 10 * n, {"cpu_utilization_percentage": float(n)})], "tracking: no GPUs here")
         for n in range(3)},
        {1: NodeSamples({"host": "host-1"}, [(3_000, {"cpu_utilization_percentage": 50.0})])},
    ]
    taken = threading.Event()

    def take() -> dict[int, NodeSamples]:
        if not arrivals:
            taken.set()
            return {}
        return arrivals.pop(0)

    warnings: list[str] = []
    logger = NodeMetricsLogger(handle.run_id, take, interval_s=0.05, tracking_uri=uri, warn=warnings.append,
                               first={2: NodeSamples({"host": "host-2"}, [(500, {"cpu_utilization_percentage": 7.0})])})
    logger.start()
    wait_for(taken.is_set, "every arrival to be taken", timeout=60)
    logger.stop()
    tags = client.get_run(handle.run_id).data.tags
    for n in range(3):
        assert (tags[f"air.host.node_{n}"], tags[f"air.ray_node_id.node_{n}"], tags[f"air.ip.node_{n}"]) == (
            f"host-{n}", f"id-{n}", f"10.0.0.{n}")
    history = {n: sorted((m.step, m.timestamp, m.value) for m in client.get_metric_history(
        handle.run_id, f"system/node_{n}/cpu_utilization_percentage")) for n in range(3)}
    assert history == {0: [(0, 1_000, 0.0)], 1: [(0, 1_010, 1.0), (1, 3_000, 50.0)],
                       2: [(0, 500, 7.0), (1, 1_020, 2.0)]}
    assert warnings == ["tracking: no GPUs here (node 0; other nodes saying the same are not named)"], warnings
