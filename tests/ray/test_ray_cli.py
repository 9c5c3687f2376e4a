"""Every raylet air starts is told its dashboard agent's listen port (air.backends.ray_cli), so it never
waits on the port file the agent writes late on a busy machine, and aborts after Ray's fixed 15 s: the
nodes air starts itself (heads and joining nodes) and the nodes a workload's own `ray start` makes through
the `ray` shim, which runs the user's Ray by its own interpreter.

The nodes here are real; each test reads the raylet's command line from /proc.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from air.backends.ray_cli import given_listen_port
from air.backends.ray_cluster import RayAuth, processes_with_env, ray_cli_under, start_ray_node
from air.backends.ray_shim import _script_python, install_shim, workload_ray_env
from air.launcher import reserve_port
from air.settings import AIR_PROCESS_TAG, AIR_RAY_NODE
from proc_helpers import wait_for

pytestmark = pytest.mark.ray

OBJECT_STORE = 80 * 1024 * 1024


def raylet_flag(processes: list[psutil.Process]) -> list[str]:
    """The --dashboard_agent_listen_port arguments of the raylet among `processes` (one raylet expected)."""
    raylets = [p for p in processes if p.name() == "raylet"]
    assert len(raylets) == 1, [p.name() for p in processes]
    return [arg for arg in raylets[0].cmdline() if arg.startswith("--dashboard_agent_listen_port")]


def agent_listens_on(processes: Callable[[], list[psutil.Process]], port: int) -> None:
    """Wait (bounded) until the node's dashboard agent listens on `port`: the port the raylet was told is
    the agent's own. The agent is the raylet's child (its retitled memory may no longer show air's marker),
    and may not even be started yet when `ray start` returns."""

    def listening() -> bool:
        for raylet in (p for p in processes() if p.name() == "raylet"):
            try:
                for child in raylet.children():
                    if any(c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN
                           for c in child.net_connections(kind="tcp")):
                        return "DashboardAgent" in child.name() or "agent.py" in " ".join(child.cmdline())
            except psutil.Error:
                continue
        return False

    wait_for(listening, f"the dashboard agent listening on {port}", timeout=300, interval=0.5)


def test_the_listen_port_is_read_in_either_spelling_and_only_when_real() -> None:
    assert given_listen_port(["start", "--head", "--dashboard-agent-listen-port=5123"]) == 5123
    assert given_listen_port(["start", "--dashboard-agent-listen-port", "5124", "--block"]) == 5124
    assert given_listen_port(["start", "--dashboard-agent-listen-port=0"]) is None  # Ray's "pick one"
    assert given_listen_port(["start", "--head"]) is None


def test_a_console_scripts_interpreter_is_found_and_anything_else_is_left_alone(tmp_path: Path) -> None:
    direct = tmp_path / "direct"
    direct.write_text(f"#!{sys.executable}\nfrom ray.scripts.scripts import main\n")
    assert _script_python(str(direct)) == sys.executable
    via_env = tmp_path / "via_env"
    via_env.write_text("#!/usr/bin/env python3\nimport sys\n")
    assert _script_python(str(via_env)) is not None and "python3" in Path(_script_python(str(via_env)) or "").name
    shell = tmp_path / "shell"
    shell.write_text("#!/bin/sh\nexec ray \"$@\"\n")
    assert _script_python(str(shell)) is None
    binary = tmp_path / "binary"
    binary.write_bytes(b"\x7fELF\x02\x01\x01\x00")
    assert _script_python(str(binary)) is None
    assert _script_python(str(tmp_path / "missing")) is None


def test_a_head_and_a_joining_node_tell_their_raylets_the_agents_port() -> None:
    auth = RayAuth.new_token()
    head = start_ray_node(head=True, num_cpus=1, object_store_memory=OBJECT_STORE, auth=auth)
    try:
        worker = start_ray_node(head=False, address=head.address, num_cpus=1, object_store_memory=OBJECT_STORE,
                                auth=auth)
        try:
            for node in (head, worker):
                port = node.ports["dashboard-agent-listen-port"]
                assert raylet_flag(node.processes()) == [f"--dashboard_agent_listen_port={port}"]
                agent_listens_on(node.processes, port)
            # The cluster works: a task runs on it and both nodes are alive.
            env = {**os.environ, **auth.env(), "RAY_ADDRESS": head.address}
            done = subprocess.run(
                [sys.executable, "-c", "import ray; ray.init(); "
                 "print(ray.get(ray.remote(lambda: 6 * 7).remote()), sum(n['Alive'] for n in ray.nodes()))"],
                env=env, capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, done.stdout + done.stderr
            assert done.stdout.split()[-2:] == ["42", "2"]
        finally:
            worker.stop()
    finally:
        head.stop()
    assert not head.processes() and not worker.processes()


def test_a_workloads_own_ray_start_tells_its_raylet_the_agents_port(tmp_path: Path) -> None:
    """Through the shim: the user's `ray` (this environment's console script, first on PATH after the
    shim) is run by its own interpreter through ray_cli; ports the command did not give are filled in."""
    shim_dir = install_shim(tmp_path / "shim")
    ray_tmpdir = Path(f"/tmp/air-test-{os.getpid()}-{tmp_path.name[-8:]}")
    ray_tmpdir.mkdir()
    with reserve_port("0.0.0.0") as head_port:
        env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
               **workload_ray_env(node_rank=0, head_port=head_port.port, shim_dir=shim_dir, ray_tmpdir=ray_tmpdir,
                                  auth=RayAuth.new_token(),
                                  path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")}
    env[AIR_PROCESS_TAG] = f"raycli-{os.getpid()}-{tmp_path.name}"
    env["NODE_RANK"] = "0"
    marker = f"{env[AIR_PROCESS_TAG]}-ray-node0"
    try:
        done = subprocess.run([str(shim_dir / "ray"), "start", "--head", "--num-cpus=1",
                               f"--object-store-memory={OBJECT_STORE}"], env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr
        processes = processes_with_env(AIR_RAY_NODE, marker)
        flag = raylet_flag(processes)
        assert len(flag) == 1 and int(flag[0].partition("=")[2]) > 0
        agent_listens_on(lambda: processes_with_env(AIR_RAY_NODE, marker), int(flag[0].partition("=")[2]))
    finally:
        stopped = subprocess.run([str(shim_dir / "ray"), "stop"], env=env, capture_output=True, text=True,
                                 timeout=300)
        subprocess.run(["rm", "-rf", str(ray_tmpdir)], check=False)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert not processes_with_env(AIR_RAY_NODE, marker)


def test_ray_start_leaves_out_the_cli_commands_it_never_runs() -> None:
    """`ray start` through ray_cli imports neither Ray Serve's, the jobs' nor the state commands (pandas
    and FastAPI came with them: 2.4 s of CPU for every node started); any other command is Ray's whole CLI."""
    python, cli = ray_cli_under(sys.executable)

    def imported(*args: str) -> tuple[str, set[str]]:
        done = subprocess.run([python, "-X", "importtime", cli, *args], capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        names = {line.rpartition("|")[2].strip() for line in done.stderr.splitlines() if line.startswith("import time")}
        return done.stdout, names

    shown, names = imported("start", "--help")
    assert "--dashboard-agent-listen-port" in shown and "--head" in shown
    assert not names & {"ray.serve", "ray.dashboard.modules.job.sdk", "pandas", "fastapi"}
    shown, names = imported("--help")
    assert {"job", "list", "summary"} <= {line.split()[0] for line in shown.splitlines()
                                                     if line.startswith("  ") and line.split()}
    assert {"ray.serve", "ray.dashboard.modules.job.sdk"} <= names  # (Serve's own command needs ray[serve])
