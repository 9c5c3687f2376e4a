"""The Ray backend on a real 3-node Ray cluster: gang placement, node env, logs, failure, loss, teardown."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
from ray_helpers import SEED_000_COMMAND, never

from air.accelerators import AcceleratorType, cpu_type, parse_accelerator_type
from air.backends.base import NodeLaunch
from air.backends.ray_agent import agent_root
from air.backends.ray_agent import tagged_processes_any_node as tagged_processes
from air.backends.ray_backend import RayBackend
from air.errors import GPUValidationError
from air.settings import AIR_PROCESS_TAG
from proc_helpers import alive, wait_for

pytestmark = pytest.mark.ray


@pytest.fixture
def backend(ray_cluster) -> RayBackend:
    return RayBackend(ray_cluster.address, poll_wait_s=0.2, wait_report_s=0.5)


def node_tasks(tmp_path: Path, script: str, num_nodes: int, cwd: Path | None = None) -> list[NodeLaunch]:
    return [NodeLaunch.command(node_rank=n, argv=["bash", "-c", script],
                     env={"NODE_RANK": str(n), "NUM_NODES": str(num_nodes)},
                     log_path=tmp_path / "logs" / f"node_{n}.log", cwd=cwd)
            for n in range(num_nodes)]


def run_id() -> str:
    return f"run-260101-{uuid.uuid4().hex[:8]}"


def test_two_cpu_nodes_get_distinct_ranks_and_one_master(backend: RayBackend, tmp_path: Path) -> None:
    rid = run_id()
    allocation = backend.acquire(rid, cpu_type(1), 2, should_stop=never, on_wait=lambda _: None)
    assert allocation is not None
    assert len({n["node_id"] for n in allocation.details["nodes"]}) == 2  # STRICT_SPREAD: distinct nodes
    lines: list[tuple[int, str, str]] = []
    try:
        tasks = node_tasks(tmp_path, 'echo "rank=$NODE_RANK addr=$MASTER_ADDR port=$MASTER_PORT '
                           'cuda=[$CUDA_VISIBLE_DEVICES]"; echo to-stderr >&2', 2)
        handle = backend.start(allocation, tasks, tag=f"air-{rid}", on_line=lambda n, _i, s, t: lines.append((n, s, t)))
        outcome = handle.wait(timeout_s=60, should_stop=never)
    finally:
        backend.release(allocation)
    assert outcome.ok, outcome
    assert [e.returncode for e in outcome.exits] == [0, 0]
    logs = [(tmp_path / "logs" / f"node_{n}.log").read_text() for n in range(2)]
    ranks = {line.split()[0] for log in logs for line in log.splitlines() if line.startswith("rank=")}
    masters = {line.split()[1] + line.split()[2] for log in logs for line in log.splitlines() if line.startswith("rank=")}
    assert ranks == {"rank=0", "rank=1"}
    assert len(masters) == 1, logs
    assert all("cuda=[]" in log and "to-stderr" in log for log in logs)
    assert {(n, s) for n, s, t in lines if t == "to-stderr"} == {(0, "stderr"), (1, "stderr")}


def test_gpu_shape_schedules_on_the_node_that_advertises_it(backend: RayBackend, tmp_path: Path) -> None:
    backend.check_shape(parse_accelerator_type("GPU_2xH100"), 1)
    with pytest.raises(GPUValidationError, match="2 × H100"):
        backend.check_shape(parse_accelerator_type("GPU_2xH100"), 2)
    with pytest.raises(GPUValidationError, match="0 node"):
        backend.check_shape(AcceleratorType("GPU", 1, "A100"), 1)
    rid = run_id()
    allocation = backend.acquire(rid, parse_accelerator_type("GPU_2xH100"), 1, should_stop=never,
                                 on_wait=lambda _: None)
    assert allocation is not None and allocation.slots_per_node == (("0", "1"),)
    try:
        # The only GPU node is busy now: a second run queues, says why, and gives up when told to.
        waits: list[str] = []
        second = backend.acquire(run_id(), parse_accelerator_type("GPU_2xH100"), 1,
                                 should_stop=lambda: len(waits) >= 2, on_wait=waits.append)
        assert second is None
        assert waits and waits[0].startswith("waiting for capacity:") and "GPU 2" in waits[0]
        handle = backend.start(allocation, node_tasks(tmp_path, "echo cuda=$CUDA_VISIBLE_DEVICES", 1),
                                       tag=f"air-{rid}")
        assert handle.wait(timeout_s=60, should_stop=never).ok
    finally:
        backend.release(allocation)
    assert "cuda=0,1" in (tmp_path / "logs" / "node_0.log").read_text()


def test_a_failing_node_ends_the_others(backend: RayBackend, tmp_path: Path) -> None:
    rid, tag = run_id(), f"air-{run_id()}"
    allocation = backend.acquire(rid, cpu_type(1), 2, should_stop=never, on_wait=lambda _: None)
    assert allocation is not None
    try:
        script = 'if [ "$NODE_RANK" = 1 ]; then sleep 0.5; echo boom >&2; exit 3; fi; sleep 300'
        handle = backend.start(allocation, node_tasks(tmp_path, script, 2), tag=tag)
        started = time.monotonic()
        outcome = handle.wait(timeout_s=120, should_stop=never)
    finally:
        backend.release(allocation)
    assert time.monotonic() - started < 30
    assert outcome.first_failure is not None and outcome.first_failure.node_rank == 1
    assert outcome.first_failure.returncode == 3
    assert outcome.exits[0].killed_by_air
    assert "boom" in (tmp_path / "logs" / "node_1.log").read_text()
    assert not tagged_processes(tag)


def test_terminate_and_timeout_leave_no_process_on_any_node(backend: RayBackend, tmp_path: Path) -> None:
    rid = run_id()
    allocation = backend.acquire(rid, cpu_type(1), 2, should_stop=never, on_wait=lambda _: None)
    assert allocation is not None
    # Children that leave the process group, like DataLoader workers or daemons, must go too.
    script = "setsid sleep 300 & sleep 300 & echo started; wait"
    try:
        tag = f"air-{rid}-0"
        handle = backend.start(allocation, node_tasks(tmp_path / "a", script, 2), tag=tag)
        wait_for(lambda: len(tagged_processes(tag)) >= 6, "both nodes' processes", timeout=30)
        handle.terminate()
        assert not tagged_processes(tag)
        tag = f"air-{rid}-1"
        handle = backend.start(allocation, node_tasks(tmp_path / "b", script, 2), tag=tag)
        outcome = handle.wait(timeout_s=2, should_stop=never)
        assert outcome.timed_out and not outcome.ok
        assert not tagged_processes(tag)
        assert "started" in (tmp_path / "b" / "logs" / "node_1.log").read_text()
    finally:
        backend.release(allocation)


def test_code_folder_is_shipped_when_asked(ray_cluster, tmp_path: Path) -> None:
    code = tmp_path / "snapshot"
    (code / "pkg").mkdir(parents=True)
    (code / "pkg" / "marker.txt").write_text("shipped-code\n")
    backend = RayBackend(ray_cluster.address, code_shipping="always", poll_wait_s=0.2)
    rid = run_id()
    allocation = backend.acquire(rid, cpu_type(1), 1, should_stop=never, on_wait=lambda _: None)
    assert allocation is not None
    try:
        task = NodeLaunch.command(0, ["bash", "-c", 'cat pkg/marker.txt; echo "pwd=$(pwd) src=$CODE_SOURCE_PATH"'],
                        {"CODE_SOURCE_PATH": str(code)}, tmp_path / "node_0.log", cwd=code)
        assert backend.start(allocation, [task], tag=f"air-{rid}").wait(timeout_s=60, should_stop=never).ok
    finally:
        backend.release(allocation)
    log = (tmp_path / "node_0.log").read_text()
    assert "shipped-code" in log
    pwd = log.split("pwd=")[1].split()[0]
    assert pwd != str(code) and "air-agent" in pwd and f"src={pwd}" in log


def test_reap_ends_tagged_leftovers(backend: RayBackend) -> None:
    tag = f"air-leftover-{uuid.uuid4().hex[:6]}"
    proc = subprocess.Popen(["sleep", "300"], env={**os.environ, "AIR_PROCESS_TAG": tag}, start_new_session=True)
    try:
        assert backend.reap(tag) >= 1
        assert proc.wait(timeout=10) is not None
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_node_lost_mid_attempt_is_reported_and_the_rest_ended(ray_cluster, backend: RayBackend,
                                                                tmp_path: Path) -> None:
    victim = ray_cluster.add_node(num_cpus=1)
    rid = run_id()
    tag = f"air-{rid}"
    allocation = None
    try:
        # Four 1-CPU bundles, strictly spread: every node of the cluster, the victim included.
        allocation = backend.acquire(rid, cpu_type(1), 4, should_stop=never, on_wait=lambda _: None)
        assert allocation is not None
        # A child under each node's bash: Ray kills a dying worker's direct children, not theirs.
        handle = backend.start(allocation, node_tasks(tmp_path, "echo up; sleep 300 & wait", 4), tag=tag)
        wait_for(lambda: len(tagged_processes(tag)) >= 8, "all four nodes running", timeout=30)
        raylet = [p for p in victim.processes() if p.name() == "raylet"]
        assert raylet
        raylet[0].kill()
        started = time.monotonic()
        outcome = handle.wait(timeout_s=120, should_stop=never)
        assert outcome.lost_node is not None and outcome.lost_node.startswith("node ")
        assert outcome.lost_node.endswith(" lost")
        assert time.monotonic() - started < 30
        # The victim's own processes are ended by its sentinel once its agent is gone, and its folder removed.
        # (A bound on an event, not a speed.)
        def left() -> list[int]:
            return alive(p.pid for p in tagged_processes(tag))

        try:
            wait_for(lambda: not left(), "no process of the attempt left", timeout=120)
        except AssertionError as exc:  # which processes, of which node, and who their parents are
            raise AssertionError(f"{exc}: {describe(left())}") from None
        backend.release(allocation)
        allocation = None
        wait_for(lambda: not agent_root(rid, 0).parent.exists(), "the run's node folders removed", timeout=120)
    finally:
        if allocation is not None:
            backend.release(allocation)
        victim.stop(grace_s=1.0)
        ray_cluster.nodes.remove(victim)





def describe(pids: list[int]) -> list[str]:
    """Each process's pid, name, command line, parent and air's tag, for a failure message."""
    described = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            process = psutil.Process(pid)
            parent = process.parent()
            described.append(f"{process.pid} {process.name()} {' '.join(process.cmdline())[:120]!r} "
                             f"parent={parent.pid if parent else None}:{parent.name() if parent else ''} "
                             f"tag={process.environ().get(AIR_PROCESS_TAG)}")
    return described


def run_seed000_command(backend, tmp_path: Path, extra_env: dict[str, str] | None = None):
    """Seed 000's command on two CPU nodes of `backend`; returns (outcome, node logs, tag, seconds)."""
    rid = run_id()
    tag = f"air-{rid}"
    allocation = backend.acquire(rid, cpu_type(1), 2, should_stop=never, on_wait=lambda _: None)
    assert allocation is not None
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    tasks = [NodeLaunch.command(n, ["bash", "-c", SEED_000_COMMAND], {"NODE_RANK": str(n), "PATH": path, **(extra_env or {})},
                      tmp_path / f"node_{n}.log") for n in range(2)]
    try:
        started = time.monotonic()
        outcome = backend.start(allocation, tasks, tag=tag).wait(timeout_s=240, should_stop=never)
        took = time.monotonic() - started
    finally:
        backend.release(allocation)
    logs = [(tmp_path / f"node_{n}.log").read_text() for n in range(2)]
    assert outcome.ok, (outcome, logs)
    assert "alive nodes: 2" in logs[0], logs[0]
    assert "[air] ray start: GCS port 6379 ->" in logs[0]
    assert "the head node stopped" in logs[1]  # node 1's `ray start --block` ended by itself
    assert not tagged_processes(tag)
    return outcome, logs, tag, took


def test_a_command_that_starts_ray_by_hand_works_on_two_nodes(backend: RayBackend, tmp_path: Path) -> None:
    """Seed 000's command, unchanged but for CPUs: both nodes share this host and the host runs another
    Ray (the test cluster) on its own ports, so Ray's defaults would collide without air's `ray` shim."""
    _, _, _, took = run_seed000_command(backend, tmp_path)
    assert took < 180


def test_a_head_air_starts_waits_longer_for_its_dashboard(ray_cluster) -> None:
    """The session head was started by air's start_ray_node with its dashboard: its dashboard process
    inherited the `ray start` environment, which had air's longer wait (Ray's 60 s failed a start in CI)."""
    from air.backends.ray_cluster import DASHBOARD_STARTUP_WAIT_S
    from air.settings import AIR_RAY_NODE

    head = ray_cluster.nodes[0]
    waits = []
    for proc in psutil.process_iter():
        try:
            environ = proc.environ()
            if environ.get(AIR_RAY_NODE) == head.marker and any("dashboard.py" in part for part in proc.cmdline()):
                waits.append(environ.get("RAY_DASHBOARD_STARTUP_TIMEOUT_S"))
        except psutil.Error:
            continue
    assert waits and set(waits) == {str(DASHBOARD_STARTUP_WAIT_S)}


def test_the_nodes_air_starts_run_in_sessions_of_their_own(ray_cluster) -> None:
    """Each node's `ray start` ran in a session of its own, which its daemons keep (OWN_SESSION: the kernel's
    autogroup scheduler then shares a busy machine with Ray's start-up as with one more group, rather than
    one process among the caller's many busy ones); air stops them by marker, not by session."""
    mine = os.getsid(0)
    sessions = []
    for node in ray_cluster.nodes:
        node_sessions = set()
        for proc in node.processes():
            with contextlib.suppress(ProcessLookupError):  # a task's worker that ended meanwhile
                node_sessions.add(os.getsid(proc.pid))
        assert len(node_sessions) == 1, node_sessions
        sessions.append(node_sessions.pop())
    assert mine not in sessions
    assert len(set(sessions)) == len(ray_cluster.nodes)
