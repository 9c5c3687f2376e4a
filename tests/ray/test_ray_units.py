"""Pure parts of the Ray integration: the `ray start` rewrite of the shim, Prometheus parsing, shapes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from air.backends.ray_backend import RayBackend
from air.backends.ray_cluster import RayAuth
from air.backends.ray_shim import local_workload_ray_env, rewrite_start, workload_ray_env
from air.distributed.call_run import plan_shape
from air.distributed.shape import check_settings
from air.errors import GPUValidationError, RuntimeConfigurationError
from air.ray.metrics import metric_key, parse_prometheus


def test_head_port_is_moved_and_missing_ports_are_filled() -> None:
    env = {"AIR_RAY_HEAD_PORT": "41000", "MASTER_ADDR": "10.0.0.5"}
    args, notes = rewrite_start(["--head", "--port=6379", "--num-gpus", "8", "--dashboard-host=0.0.0.0"], env)
    assert "--port=41000" in args and "--port=6379" not in args
    assert "--num-gpus" in args and "8" in args
    for option in ("dashboard-agent-listen-port", "metrics-export-port", "node-manager-port", "dashboard-port",
                   "ray-client-server-port", "runtime-env-agent-port"):
        assert any(a.startswith(f"--{option}=") for a in args), option
    assert "--min-worker-port=0" in args
    assert notes and "6379 -> 41000" in notes[0]


def test_the_ports_filled_in_are_distinct_and_leave_the_given_ones_alone() -> None:
    """Ray refuses two components on one port (a run failed on "runtime_env_agent is trying to use a port
    number ... used by other components" when two picks got the same released port back)."""
    env = {"AIR_RAY_HEAD_PORT": "41000", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "41001"}
    for _ in range(30):
        args, _ = rewrite_start(["--head", "--port=6379", "--metrics-export-port=9000"], env)
        ports = [int(a.split("=", 1)[1]) for a in args if a.startswith("--") and a.split("=", 1)[0].endswith("-port")
                 and "worker" not in a]
        assert len(ports) == len(set(ports)) == 9, args  # 8 components + the GCS
        assert 41000 in ports and 9000 in ports and 41001 not in ports, args


def test_a_joining_node_follows_the_moved_head_port_and_keeps_given_ports() -> None:
    env = {"AIR_RAY_HEAD_PORT": "41000", "MASTER_ADDR": "10.0.0.5"}
    args, _ = rewrite_start(["--address", "10.0.0.5:6379", "--metrics-export-port", "9000", "--block"], env)
    assert "--address=10.0.0.5:41000" in args and "10.0.0.5:6379" not in args
    assert "9000" in args and not any(a.startswith("--metrics-export-port=") for a in args)
    assert not any(a.startswith("--dashboard-port=") for a in args)  # head-only options stay off workers
    other, _ = rewrite_start(["--address=elsewhere:6379"], env)
    assert "--address=elsewhere:6379" in other  # another cluster the user names explicitly is left alone


def test_a_joining_node_keeps_its_own_temp_dir() -> None:
    """Not the head's: two nodes of one host would share a session folder and send every log line twice."""
    env = {"AIR_RAY_HEAD_PORT": "41000", "MASTER_ADDR": "10.0.0.5", "RAY_TMPDIR": "/tmp/air-rt-node1"}
    join, _ = rewrite_start(["--address=10.0.0.5:6379", "--block"], env)
    assert "--temp-dir=/tmp/air-rt-node1/ray" in join
    head, _ = rewrite_start(["--head", "--port=6379"], env)
    assert not any(a.startswith("--temp-dir") for a in head)  # the head's comes from RAY_TMPDIR already
    given, _ = rewrite_start(["--address=10.0.0.5:6379", "--temp-dir", "/data/ray"], env)
    assert "/data/ray" in given and not any(a.startswith("--temp-dir=") for a in given)


def test_a_gcs_on_master_port_stays_there() -> None:
    """MASTER_PORT is free on node 0 already (air reserved it): a command that uses it keeps it."""
    env = {"AIR_RAY_HEAD_PORT": "41000", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29555"}
    head, notes = rewrite_start(["--head", "--port=29555"], env)
    assert "--port=29555" in head and notes == []
    join, _ = rewrite_start(["--address=10.0.0.5:29555", "--block"], env)
    assert "--address=10.0.0.5:29555" in join
    moved, _ = rewrite_start(["--head", "--port=6379"], env)
    assert "--port=41000" in moved


def test_workload_env_is_explicit_about_auth_and_temp_dir(tmp_path: Path) -> None:
    env = workload_ray_env(node_rank=1, head_port=41000, shim_dir=tmp_path / "bin", ray_tmpdir=tmp_path / "rt",
                           auth=RayAuth("token", "secret"), path="/usr/bin", mlflow_run_id="abc")
    assert env["PATH"] == f"{tmp_path / 'bin'}:/usr/bin"
    assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN"] == "secret"
    assert env["RAY_TMPDIR"] == str(tmp_path / "rt") and env["AIR_RAY_HEAD_PORT"] == "41000"
    assert "air.ray.train_callback.MlflowReportCallback" in env["RAY_TRAIN_CALLBACKS"]
    mine = workload_ray_env(node_rank=0, head_port=41000, shim_dir=tmp_path / "bin", ray_tmpdir=tmp_path / "rt",
                            auth=RayAuth("token", "secret"), mlflow_run_id="abc", train_callbacks="my.Callback")
    assert mine["RAY_TRAIN_CALLBACKS"].split(",") == ["my.Callback", "air.ray.train_callback.MlflowReportCallback",
                                                      "air.ray.train_callback.AirTrainCallback"]


def test_local_nodes_share_head_port_and_token_but_not_temp_dirs(tmp_path: Path) -> None:
    with local_workload_ray_env(2, shim_dir=tmp_path / "bin", path="/usr/bin") as envs:
        assert envs[0]["AIR_RAY_HEAD_PORT"] == envs[1]["AIR_RAY_HEAD_PORT"]
        assert envs[0]["RAY_AUTH_TOKEN"] == envs[1]["RAY_AUTH_TOKEN"]
        assert envs[0]["RAY_TMPDIR"] != envs[1]["RAY_TMPDIR"]
        dirs = [Path(e["RAY_TMPDIR"]) for e in envs]
        assert all(d.is_dir() for d in dirs) and (tmp_path / "bin" / "ray").is_file()
    assert not any(d.exists() for d in dirs)


def test_prometheus_samples_become_mlflow_keys() -> None:
    text = "\n".join([
        "# HELP ray_tasks Current number of tasks",
        'ray_tasks{Name="train",State="RUNNING",SessionName="s",Version="2.60.0"} 3.0',
        'ray_tasks{Name="train",State="RUNNING",SessionName="s",Version="2.60.0",WorkerId="w2"} 2.0',
        'ray_component_uss_mb{Component="/usr/bin/python",SessionName="s"} 12.5',
        'ray_other{a="b"} 1',
    ])
    values = parse_prometheus(text, ["ray_tasks", "ray_component_uss_mb"])
    assert values == {("ray_tasks", (("Name", "train"), ("State", "RUNNING"))): 5.0,
                      ("ray_component_uss_mb", (("Component", "/usr/bin/python"),)): 12.5}
    assert metric_key("system/ray", "ray_tasks", (("Name", "train"), ("State", "RUNNING"))) == \
        "system/ray/ray_tasks/train/RUNNING"
    assert metric_key("system/ray/node_0", "ray_component_uss_mb", (("Component", "/usr/bin/python"),)) == \
        "system/ray/node_0/ray_component_uss_mb/python"


def test_versions_compare_what_unpickling_needs() -> None:
    from air.backends.ray_backend import _comparable

    assert _comparable("torch", "2.13.0+cpu") == _comparable("torch", "2.13.0+cu124")
    assert _comparable("torch", "2.13.0") != _comparable("torch", "2.12.1")
    assert _comparable("python", "3.11.7") == _comparable("python", "3.11.9") != _comparable("python", "3.12.1")
    assert _comparable("cloudpickle", "3.1.2") != _comparable("cloudpickle", "3.1.1")


class FakeCluster(RayBackend):
    """What RayBackend.plan_shape reads from the cluster: its alive nodes."""

    def __init__(self, nodes: list[dict]) -> None:
        super().__init__("127.0.0.1:1")
        self.nodes = nodes

    def _alive_nodes(self) -> list[dict]:
        return self.nodes

    def describe_capacity(self) -> str:
        return f"{len(self.nodes)} nodes"


CLUSTER = FakeCluster([
    {"Resources": {"CPU": 8, "GPU": 8, "accelerator_type:H100": 1}},
    {"Resources": {"CPU": 8, "GPU": 8, "accelerator_type:H100": 1}},
    {"Resources": {"CPU": 4, "GPU": 1, "accelerator_type:A10G": 1}},
])


@pytest.mark.parametrize(("count", "kind", "expected"), [
    (16, "H100", ("GPU_8xH100", 2)), (4, "h100", ("GPU_4xH100", 1)), (1, "A10", ("GPU_1xA10", 1)),
    (16, "GPU_8xH100", ("GPU_8xH100", 2)), (4, "CPU", ("CPU_4xCPU", 1)), (2, "cpu_1xcpu", ("CPU_1xCPU", 2)),
])
def test_remote_shapes(count: int, kind: str, expected: tuple[str, int]) -> None:
    accelerator, nodes = plan_shape(CLUSTER, check_settings(count, kind, True))
    assert (accelerator.name, nodes) == expected


def test_remote_shapes_that_cannot_fit_or_are_incomplete() -> None:
    with pytest.raises(GPUValidationError, match="do not fit"):
        plan_shape(CLUSTER, check_settings(24, "H100", True))
    with pytest.raises(RuntimeConfigurationError, match="accelerator_type"):
        plan_shape(CLUSTER, check_settings(8, None, True))


def test_a_gap_after_the_last_batch_is_noted_in_the_nodes_own_log_before_it_closes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lines dropped after the last batch shipped, by a node that then ends before the submitting side asks
    again (a loaded machine): the node's own log notes that gap too, so its notes add up to the count the
    submitting side gets (a CI run once saw 181,723 noted there of 243,147 dropped). The real agent, a
    real process that prints 1,000 lines, waits for a file, prints 1,000 more and ends; a buffer of 100."""
    import sys
    import time

    from air.backends import ray_agent
    from air.launcher.node import ProcessSpec
    from proc_helpers import wait_for

    monkeypatch.setenv("AIR_AGENT_DIR", str(tmp_path / "agents"))
    monkeypatch.setattr(ray_agent, "MAX_BUFFERED_LINES", 100)
    go_on = tmp_path / "go-on"
    code = ("import os, sys, time\nfor i in range(1000): print(i)\nsys.stdout.flush()\n"
            f"while not os.path.exists({str(go_on)!r}): time.sleep(0.05)\nfor i in range(1000, 2000): print(i)\n")
    agent = ray_agent.NodeAgent("run-late-gap", 0)
    printer = ProcessSpec(name="node 0", argv=[sys.executable, "-c", code], env=dict(os.environ),
                          log_path=tmp_path / "agent-node.log")
    agent.start([printer], tag="late-gap-test")
    deadline = time.monotonic() + 120
    reply = agent.poll(0)
    while (not reply.lines or reply.lines[-1][2] != "999") and time.monotonic() < deadline:
        time.sleep(0.1)
        reply = agent.poll(0)
    assert reply.lines[-1][2] == "999" and reply.dropped == 900, reply  # the first gap, counted by a poll
    go_on.touch()
    wait_for(lambda: agent._result is not None, "the node to end", timeout=120)  # no poll meanwhile
    last = agent.poll(reply.cursor)
    assert last.exits is not None and last.dropped == 1800, last
    assert [text for _, _, text in last.lines] == [str(i) for i in range(1900, 2000)]
    own = Path(last.node_log).read_text().splitlines()
    assert [int(line) for line in own if not line.startswith("[air] ")] == list(range(2000))
    notes = [line for line in own if line.startswith("[air] ")]
    assert [int(note.split()[1].replace(",", "")) for note in notes] == [900, 900], notes
    assert "1,800 in all" in notes[-1], notes


def test_lines_an_agent_drops_are_counted_in_the_node_log_not_silent(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent whose buffer overflows (the node printed faster than the submitting side fetched) keeps the
    newest lines; the node's log says, where the gap is, how many were dropped, once per gap. The agent is
    the real one with a real process (it needs Ray only to be placed), its buffer made small."""
    import sys
    import time

    from air.accelerators import parse_accelerator_type
    from air.backends import ray_agent
    from air.backends.base import Allocation, NodeLaunch
    from air.backends.ray_attempt import Held, RayAttempt
    from air.launcher.node import ProcessSpec

    monkeypatch.setenv("AIR_AGENT_DIR", str(tmp_path / "agents"))
    monkeypatch.setattr(ray_agent, "MAX_BUFFERED_LINES", 100)
    agent = ray_agent.NodeAgent("run-dropped", 0)
    printer = ProcessSpec(name="node 0", argv=[sys.executable, "-c", "for i in range(1000): print(i)"],
                          env=dict(os.environ), log_path=tmp_path / "agent-node.log")
    agent.start([printer], tag="dropped-test")
    deadline = time.monotonic() + 120
    reply = agent.poll(0)
    while reply.exits is None and time.monotonic() < deadline:
        time.sleep(0.1)
        reply = agent.poll(0)
    assert reply.exits is not None and reply.dropped == 900
    assert [text for _, _, text in reply.lines] == [str(i) for i in range(900, 1000)]

    log = tmp_path / "node_0.log"
    attempt = RayAttempt(Allocation("run-dropped", parse_accelerator_type("CPU_1xCPU"), 1, (("0",),)),
                         Held(pg=None, agents=[agent], infos=[{}], bundle={}),
                         [NodeLaunch(0, [printer], log)], tag="dropped-test", on_line=None, poll_wait_s=0.0,
                         master_addr="127.0.0.1", master_port=0)
    attempt._deliver(0, reply)
    attempt._deliver(0, ray_agent.NodePoll([], reply.cursor, reply.dropped, reply.exits, True))  # no new gap
    attempt._close_files()
    lines = log.read_text().splitlines()
    assert lines[0].startswith("[air] 900 line(s) of node 0 dropped here") and "900 dropped in all" in lines[0]
    assert lines[1:] == [str(i) for i in range(900, 1000)]
