"""Workloads on the ray profile, end to end: `air run` → supervisor → RayBackend → node agents."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from ray_helpers import SEED_000_COMMAND

from air.backends.ray_agent import tagged_processes_any_node
from air.store.paths import RunPaths, process_tag
from air.store.run_store import RunStore
from air.store.states import RunStatus
from proc_helpers import wait_for

pytestmark = pytest.mark.ray

AIR = [sys.executable, "-m", "air.cli.main"]


def air_run(yaml: Path, air_home: Path, *args: str, wait: bool = True) -> subprocess.Popen[str]:
    proc = subprocess.Popen([*AIR, "run", "-f", str(yaml), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "AIR_HOME": str(air_home)})
    if wait:
        proc.communicate(timeout=240)
    return proc


def only_run() -> object:
    runs = RunStore().list_runs(statuses="all", limit=5)
    return runs[0] if len(runs) == 1 else None


def test_two_node_cpu_workload_succeeds_with_distinct_ranks(ray_cluster, air_home: Path, tmp_path: Path) -> None:
    ray_cluster.write_profile(air_home)
    yaml = tmp_path / "w.yaml"
    yaml.write_text(
        "experiment_name: ray-two-nodes\n"
        "compute: {num_accelerators: 2, accelerator_type: CPU_1xCPU}\n"
        "command: |\n"
        "  echo \"rank=$NODE_RANK of $NUM_NODES master=$MASTER_ADDR:$MASTER_PORT\"\n"
        "max_retries: 0\n")
    proc = air_run(yaml, air_home, "--watch")
    run = RunStore().list_runs(statuses="all", limit=1)[0]
    assert proc.returncode == 0 and run.status is RunStatus.SUCCESS, (run, proc.stdout and proc.stdout.read())
    assert run.backend == "ray"
    lines = [RunPaths(run.id).node_log(0, n).read_text() for n in range(2)]
    found = [next(line for line in log.splitlines() if line.startswith("rank=")) for log in lines]
    assert sorted(f.split()[0] for f in found) == ["rank=0", "rank=1"]
    assert len({f.split("master=")[1] for f in found}) == 1


def test_a_node_lost_mid_run_is_retried_once_capacity_is_back(ray_cluster, air_home: Path, tmp_path: Path) -> None:
    """Attempt 0 uses every node, one of which dies; the retry waits for capacity (reported as such)
    until a replacement node joins, then succeeds."""
    ray_cluster.write_profile(air_home)
    victim = ray_cluster.add_node(num_cpus=1)
    yaml = tmp_path / "w.yaml"
    yaml.write_text(
        "experiment_name: ray-lost-node\n"
        "compute: {num_accelerators: 4, accelerator_type: CPU_1xCPU}\n"
        "command: |\n"
        "  echo up\n"
        "  if [ \"$AIR_ATTEMPT\" = 0 ]; then sleep 300; fi\n"
        "max_retries: 1\n")
    proc = air_run(yaml, air_home, wait=False)
    replacement = None
    try:
        run = wait_for(only_run, "the run", timeout=60)
        paths = RunPaths(run.id)  # type: ignore[attr-defined]
        wait_for(lambda: all("up" in (p.read_text() if p.exists() else "") for p in
                             (paths.node_log(0, n) for n in range(4))), "attempt 0 on all 4 nodes", timeout=120)
        raylet = [p for p in victim.processes() if p.name() == "raylet"]
        raylet[0].kill()
        store = RunStore()
        wait_for(lambda: store.get_run(run.id).status is RunStatus.QUEUED and store.get_run(run.id).attempt_count == 1,
                 "the retry to wait for capacity", timeout=90)
        reason = store.get_attempt(run.id, 0).termination_reason or ""
        assert reason.startswith("node ") and reason.endswith(" lost"), reason
        replacement = ray_cluster.add_node(num_cpus=1)
        wait_for(lambda: store.get_run(run.id).status.is_terminal(), "the run to end", timeout=120)
        final = store.get_run(run.id)
        assert final.status is RunStatus.SUCCESS and final.attempt_count == 2, final
        assert "waiting for capacity" in paths.supervisor_log.read_text()
        assert not tagged_processes_any_node(process_tag(run.id))
    finally:
        if proc.poll() is None:
            proc.kill()
        for node in (victim, replacement):
            if node is not None:
                node.stop(grace_s=1.0)
                ray_cluster.nodes.remove(node)


def test_a_stopped_supervisor_ends_its_processes_on_every_ray_node(ray_cluster, air_home: Path,
                                                                   tmp_path: Path) -> None:
    """SIGTERM to the supervisor of a Ray run: INTERNAL_ERROR, and no process of the run is left on any
    node (their tags are `<run tag>.node<n>`, so the crash handler reaps sub-tags through the backend)."""
    import signal

    ray_cluster.write_profile(air_home)
    yaml = tmp_path / "w.yaml"
    yaml.write_text(
        "experiment_name: ray-supervisor-stopped\n"
        "compute: {num_accelerators: 2, accelerator_type: CPU_1xCPU}\n"
        "command: |\n"
        "  sleep 600 &\n"
        "  echo up\n"
        "  wait\n"
        "max_retries: 0\n")
    air_run(yaml, air_home)
    run = wait_for(only_run, "the run", timeout=60)
    paths = RunPaths(run.id)  # type: ignore[attr-defined]
    wait_for(lambda: all("up" in (p.read_text() if p.exists() else "") for p in
                         (paths.node_log(0, n) for n in range(2))), "both nodes up", timeout=120)
    tag = process_tag(run.id)  # type: ignore[attr-defined]
    assert len(tagged_processes_any_node(tag)) >= 4  # bash and sleep on each node
    store = RunStore()
    supervisor = store.get_run(run.id).supervisor_pid  # type: ignore[attr-defined]
    os.kill(supervisor, signal.SIGTERM)
    try:
        wait_for(lambda: store.get_run(run.id).status is RunStatus.INTERNAL_ERROR, "INTERNAL_ERROR", timeout=240)
    except AssertionError as late:  # (once, in a loaded clean-clone run: say where the supervisor was)
        log = paths.supervisor_log()
        raise AssertionError(f"{late}; supervisor {supervisor} still running: {os.path.exists(f'/proc/{supervisor}')}; "
                             f"supervisor.log ends:\n{log.read_text()[-6000:] if log.exists() else '(none)'}") from None
    wait_for(lambda: tagged_processes_any_node(tag) == [], "no process of the run on any node", timeout=60)


def test_seed000s_command_runs_on_the_local_backend_beside_another_ray(ray_cluster, air_home: Path,
                                                                       tmp_path: Path) -> None:
    """Seed 000's command (`ray start --head --port=6379`, `ray start --address=$MASTER_ADDR:6379 --block`,
    `ray stop`) on the local profile: two nodes on this host, beside another Ray (the test cluster).
    Without air's `ray` shim both nodes would want Ray's default ports and /tmp/ray, and `ray stop` would
    stop the test cluster too."""
    import psutil
    import yaml as pyyaml

    def ray_daemons() -> set[int]:
        """The test cluster's raylets and GCS (only its own: other tests may start and stop Ray meanwhile)."""
        ours = {p.pid for node in ray_cluster.nodes for p in node.processes()}
        return {p.pid for p in psutil.process_iter(["name"])
                if p.info["name"] in ("raylet", "gcs_server") and p.pid in ours}

    before = ray_daemons()
    assert before, "the test cluster's raylets and GCS"
    workload = tmp_path / "w.yaml"
    workload.write_text(pyyaml.safe_dump({
        "experiment_name": "seed000-command-local", "command": SEED_000_COMMAND, "max_retries": 0,
        "compute": {"num_accelerators": 2, "accelerator_type": "CPU_1xCPU"},
        "env_variables": {"RAY_ADDRESS": ray_cluster.address}}))  # must not lead the nodes astray
    proc = air_run(workload, air_home, "--watch")
    run = RunStore().list_runs(statuses="all", limit=1)[0]
    logs = [RunPaths(run.id).node_log(0, n).read_text() for n in range(2)]
    assert proc.returncode == 0 and run.status is RunStatus.SUCCESS, (run, logs)
    assert run.backend == "local"
    assert "alive nodes: 2" in logs[0] and "[air] ray start: GCS port 6379 ->" in logs[0]
    assert logs[0].split("gcs:")[1].split()[0] != ray_cluster.address  # the command's own cluster
    assert "the head node stopped" in logs[1]
    assert before <= ray_daemons()  # `ray stop` left the test cluster alone
    assert tagged_processes_any_node(process_tag(run.id)) == []
