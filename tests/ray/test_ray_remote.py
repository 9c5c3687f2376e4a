"""`@distributed(remote=True)` on the test Ray cluster: a run in the store, per-rank results, errors, cancel."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from air import distributed
from air.backends.ray_agent import tagged_processes_any_node
from air.errors import RuntimeConfigurationError, WorkloadFailureException
from air.store.paths import RunPaths, process_tag
from air.store.run_store import RunStore
from air.store.states import RunStatus
from proc_helpers import default_sigint, wait_for

pytestmark = pytest.mark.ray


@pytest.fixture
def ray_profile(ray_cluster, air_home: Path) -> Path:
    ray_cluster.write_profile(air_home)
    return air_home


def latest_run():
    return RunStore().list_runs(statuses="all", limit=1)[0]


def test_remote_call_returns_every_rank_in_order(ray_profile: Path, capfd: pytest.CaptureFixture[str]) -> None:
    @distributed(num_accelerators=4, accelerator_type="CPU", remote=True)
    def train(scale: int) -> tuple[int, int, int, str, float]:
        import os

        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")  # MASTER_ADDR/MASTER_PORT from air, across both nodes
        total = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(total)
        dist.destroy_process_group()
        print(f"hello from rank {os.environ['RANK']}", flush=True)
        return (int(os.environ["RANK"]), int(os.environ["NODE_RANK"]), int(os.environ["LOCAL_RANK"]),
                os.environ["MASTER_ADDR"], total.item() * scale)

    values = train.distributed(10)
    assert [v[0] for v in values] == [0, 1, 2, 3]
    assert [(v[1], v[2]) for v in values] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert len({v[3] for v in values}) == 1
    assert {v[4] for v in values} == {60.0}  # (0+1+2+3) * 10 on every rank
    out = capfd.readouterr().out
    assert "[node 1 rank 3] hello from rank 3" in out
    run = latest_run()
    assert (run.kind, run.backend, run.status, run.num_nodes, run.accelerator_type) == (
        "call", "ray", RunStatus.SUCCESS, 2, "CPU_2xCPU")
    assert "hello from rank 3" in RunPaths(run.id).node_log(0, 1).read_text()
    from mlflow import MlflowClient

    from air.tracking.store import tracking_uri

    assert run.mlflow_run_id and MlflowClient(tracking_uri()).get_run(run.mlflow_run_id).info.status == "FINISHED"


@pytest.mark.parametrize("warm", ["1", "0"])
def test_remote_ranks_start_warm_like_local_ones(warm: str, ray_profile: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each node forks its ranks from one zygote that imported torch once (cold: each rank imports it
    first); either way with the GC off for the import and back on for the function."""
    monkeypatch.setenv("AIR_WARM_START", warm)

    @distributed(num_accelerators=4, accelerator_type="CPU", remote=True)
    def lineage() -> tuple[str, bool, bool, int, int, int]:
        import gc
        import os
        import sys

        import psutil

        if os.environ.get("NEVER_SET_BY_ANYONE"):
            import torch  # noqa: F401 - named only, for the preload scan
        parent = psutil.Process(os.getppid())
        return (" ".join(parent.cmdline()), "torch" in sys.modules, gc.isenabled(), gc.get_freeze_count(),
                int(os.environ["NODE_RANK"]), parent.pid)

    values = lineage.distributed()
    assert [v[4] for v in values] == [0, 0, 1, 1]
    for parent, torch_preloaded, gc_on, frozen, _, _ in values:
        assert ("air.launcher.zygote" in parent) is (warm == "1")
        assert torch_preloaded and gc_on and frozen > 100_000
    if warm == "1":  # one zygote per node, both ranks of a node its children
        assert values[0][5] == values[1][5] != values[2][5] == values[3][5]


def test_a_rank_exception_is_raised_here(ray_profile: Path) -> None:
    @distributed(num_accelerators=2, accelerator_type="CPU_1xCPU", remote=True)
    def fails() -> int:
        import os

        if os.environ["RANK"] == "1":
            raise ValueError("bad input on rank 1")
        return 0

    with pytest.raises(ValueError, match="bad input on rank 1") as info:
        fails.distributed()
    assert getattr(info.value, "air_rank", None) == 1
    run = latest_run()
    assert run.status is RunStatus.FAILED and "ValueError" in (run.termination_reason or "")


def test_version_mismatch_is_refused_with_every_difference(ray_profile: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import air.backends.ray_backend as rb

    real = rb.local_versions()
    monkeypatch.setattr(rb, "local_versions", lambda: {**real, "torch": "1.0.0", "cloudpickle": "0.1"})

    @distributed(num_accelerators=1, accelerator_type="CPU", remote=True)
    def nothing() -> None:
        return None

    with pytest.raises(RuntimeConfigurationError) as info:
        nothing.distributed()
    text = str(info.value)
    assert "torch" in text and "(here 1.0.0)" in text and "cloudpickle" in text and "node 0" in text
    assert latest_run().status is RunStatus.FAILED


def test_air_cancel_ends_every_rank(ray_profile: Path) -> None:
    @distributed(num_accelerators=2, accelerator_type="CPU_1xCPU", remote=True)
    def forever() -> None:
        import time

        print("started", flush=True)
        time.sleep(300)

    def cancel() -> None:
        try:
            wait_for(lambda: any(r.status is RunStatus.RUNNING for r in RunStore().list_runs()),
                     "the run to be RUNNING", timeout=180)
        finally:  # as `air cancel` does: the run's own process sees TERMINATING and ends every rank
            RunStore().transition(latest_run().id, RunStatus.TERMINATING, reason="air cancel")

    thread = threading.Thread(target=cancel)
    thread.start()
    with pytest.raises(WorkloadFailureException, match="canceled"):
        forever.distributed()
    thread.join()
    run = latest_run()
    assert run.status is RunStatus.CANCELED
    assert not tagged_processes_any_node(process_tag(run.id))


INTERRUPTED_CALLER = '''
import sys
from air import distributed

@distributed(num_accelerators=2, accelerator_type="CPU_1xCPU", remote=True)
def forever():
    import time
    print("started", flush=True)
    time.sleep(300)

try:
    forever.distributed()
except KeyboardInterrupt:
    print("caller saw KeyboardInterrupt", flush=True)
    sys.exit(130)
'''


def test_ctrl_c_in_the_caller_cancels_the_run(ray_profile: Path, tmp_path: Path) -> None:
    import os
    import signal
    import subprocess
    import sys

    script = tmp_path / "caller.py"
    script.write_text(INTERRUPTED_CALLER)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "AIR_HOME": str(ray_profile)}, preexec_fn=default_sigint)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "started" in line and "[node" in line:
                break
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, "".join(lines) + rest
    assert "caller saw KeyboardInterrupt" in rest
    run = latest_run()
    assert run.status is RunStatus.CANCELED and "user signal" in (run.termination_reason or "")
    assert not tagged_processes_any_node(process_tag(run.id))


def test_ray_launch_remote_builds_a_cluster_over_two_ray_nodes(ray_profile: Path) -> None:
    """`@ray_launch(remote=True)`: the call's two nodes (two Ray nodes of the test cluster) become a new
    Ray cluster of their own (its own ports, temp dirs and token), whose driver sees both nodes."""
    from air.ray import ray_launch

    @ray_launch(num_accelerators=2, accelerator_type="CPU_1xCPU", remote=True)
    def driver() -> dict:
        import os

        import ray

        ray.init()
        nodes = [n for n in ray.nodes() if n["Alive"]]
        return {"nodes": len(nodes), "ranks": sorted(n["Labels"].get("air-node-rank", "?") for n in nodes),
                "address": os.environ["RAY_ADDRESS"]}

    values = driver.distributed()
    assert values[1] is None
    assert values[0]["nodes"] == 2 and values[0]["ranks"] == ["0", "1"], values[0]
    assert latest_run().status is RunStatus.SUCCESS
