"""`ray_launch` on a busy machine, and beside an unrelated Ray cluster.

Under load Ray's own fixed start-up waits are exceeded: the raylet aborted when its dashboard agent had not
written its port file within 15 s, and `ray start` then said "timed out during startup". air tells the raylet
that port (air.backends.ray_cli), so it no longer waits on the file; it starts each node in a session of its
own, so the kernel's autogroup scheduler shares a busy machine with Ray's start-up as with one more group
(air.backends.ray_cluster.OWN_SESSION); and it tries a start Ray gave up on again (the retry the workload
`ray` shim uses). Here 8 busy-loop processes made by the test load the machine while `ray_launch` is called
5 times; every call must succeed. Nothing here depends on how fast the machine is: the calls wait for their
clusters, and the hogs only make a failed start likely. The test is marked `alone` (tests/alone_room.py): no
other test runs beside its hogs, whose load would otherwise fall on a neighbour's bounded waits too.

The second test starts an unrelated Ray cluster (its own temp dir, ports and token) and shows that a call's
Ray processes reach only their own cluster: Ray's state API with no address (what Ray Train's
PlacementGroupCleaner calls in its thread) used to find every GCS of the machine and fail with
"Found multiple active Ray instances".
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from air.ray import ray_launch
from proc_helpers import alive

pytestmark = pytest.mark.ray

HOGS = 8
CALLS = 5
#: What `ray start` prints when the raylet aborted on its dashboard agent's port file (Ray 2.60).
RAY_TIMEOUT = ("Exception: The current node timed out during startup. This could happen because some of the "
               "raylet failed to startup or the GCS has become overloaded.")


def processes_of_calls(air_home: Path) -> list[int]:
    """Processes started for calls under this AIR_HOME (ranks, and the Ray nodes they started)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("AIR_CALL_DIR", "").startswith(str(air_home)):
                found.append(proc.pid)
        except psutil.Error:
            continue
    return found


#: Ray Train's warning, with its traceback, when its autoscaling coordinator does not answer a request
#: within 5 s: it comes from a busy CPU (Ray's text says it is safe to ignore then), not from another cluster.
RAY_OVERLOAD_WARNING = "If this only happens transiently during network partition or CPU being overloaded"


def without_overload_warnings(text: str) -> str:
    """`text` without each Ray overload warning and the traceback that follows it (up to and including its
    `ray.exceptions.GetTimeoutError` line); any other traceback stays."""
    kept: list[str] = []
    skipping = False
    for line in text.splitlines():
        if RAY_OVERLOAD_WARNING in line:
            skipping = True
        elif skipping and "ray.exceptions.GetTimeoutError" in line:
            skipping = False
        elif not skipping:
            kept.append(line)
    return "\n".join(kept)


def test_overload_warnings_are_the_only_tracebacks_taken_out() -> None:
    prefix = "[rank 0] (TrainController pid=1) "
    warned = (f"{prefix}Failed to send resource request for train-1. {RAY_OVERLOAD_WARNING}, it's safe to ignore\n"
              f"{prefix}Traceback (most recent call last):\n{prefix}  File \"x.py\", line 1\n"
              f"{prefix}ray.exceptions.GetTimeoutError: Get timed out\n{prefix}Started training worker group\n")
    assert without_overload_warnings(warned) == f"{prefix}Started training worker group"
    other = f"{prefix}Traceback (most recent call last):\n{prefix}ConnectionError: Found multiple active Ray instances"
    assert "Traceback" in without_overload_warnings(warned + other)


def runnable_now() -> int:
    """The machine's runnable tasks at this moment (/proc/loadavg's fourth field): the load the calls meet,
    which the 1-minute average only reaches a minute or more after the hogs start."""
    return int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])


@pytest.fixture
def cpu_hog() -> Iterator[list[psutil.Process]]:
    """`HOGS` busy-loop processes for the duration of the test (ended and reaped after it)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(HOGS)]
    try:
        yield [psutil.Process(p.pid) for p in procs]
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait(timeout=30)


@pytest.mark.alone
@pytest.mark.timeout(900)  # 5 Ray clusters beside 8 busy loops on 2 cores: 286 s in CI, the default is 300 s
def test_ray_launch_succeeds_five_times_in_a_row_beside_eight_busy_processes(
        air_home: Path, cpu_hog: list[psutil.Process], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIR_RAY_OBJECT_STORE_MEMORY", str(80 * 1024 * 1024))
    monkeypatch.setenv("AIR_RAY_METRICS", "0")

    @ray_launch(num_accelerators=1, accelerator_type="CPU")
    def alive_nodes() -> int:
        import ray

        ray.init()  # RAY_ADDRESS: the call's own cluster
        return len([n for n in ray.nodes() if n["Alive"]])

    runnable, loads = [], []
    for _ in range(CALLS):
        runnable.append(runnable_now())
        assert alive_nodes.distributed() == [1]
        loads.append(os.getloadavg()[0])
    assert all(hog.is_running() and hog.cpu_times().user > 0 for hog in cpu_hog)
    assert min(runnable) >= HOGS
    print(f"{CALLS} of {CALLS} calls succeeded; runnable tasks as each call began: "
          + ", ".join(map(str, runnable)) + "; 1-minute load as each ended: "
          + ", ".join(f"{load:.1f}" for load in loads))
    assert not processes_of_calls(air_home)


@pytest.mark.timeout(600)  # two Ray clusters and Ray Train on 2 busy cores: minutes, not seconds
def test_a_call_reaches_only_its_own_cluster_beside_an_unrelated_one(
        air_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    from air.backends.ray_cluster import RayAuth, start_ray_node

    monkeypatch.setenv("AIR_RAY_OBJECT_STORE_MEMORY", str(80 * 1024 * 1024))
    monkeypatch.setenv("AIR_RAY_METRICS", "0")
    other = start_ray_node(head=True, num_cpus=1, object_store_memory=80 * 1024 * 1024, auth=RayAuth.new_token())
    try:
        @ray_launch(num_accelerators=1, accelerator_type="CPU")
        def state_api() -> dict:
            import ray
            from ray.train import RunConfig, ScalingConfig
            from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer
            from ray.util.state import list_nodes

            ray.init()
            # Ray Train's controller starts the PlacementGroupCleaner, whose thread asks the state API.
            DataParallelTrainer(lambda: None, scaling_config=ScalingConfig(num_workers=1),
                                run_config=RunConfig(storage_path=str(tmp_path / "results"), name="t")).fit()

            @ray.remote(num_cpus=0)
            def from_a_worker() -> list[str]:
                # What Ray Train's PlacementGroupCleaner does in its thread: the state API, no address given.
                return [node.node_id for node in list_nodes()]

            return {"driver": ray.get_runtime_context().gcs_address, "own": ray.get_runtime_context().get_node_id(),
                    "seen_by_worker": ray.get(from_a_worker.remote())}

        value = state_api.distributed()[0]
    finally:
        other.stop()
    out, err = capfd.readouterr()
    sys.stdout.write(out)
    sys.stderr.write(err)
    assert value["driver"] != other.address
    assert value["seen_by_worker"] == [value["own"]]  # its own cluster's one node, not the other's
    assert "Found multiple active Ray instances" not in out + err
    assert "Traceback" not in without_overload_warnings(out + err)
    assert not other.processes() and not processes_of_calls(air_home)


def test_a_node_start_ray_gave_up_on_is_tried_again_after_its_partial_node_is_ended(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The failure made on demand: a `ray` that fails its first start the way Ray does on a busy machine
    (its message, exit 1, a partial node left running), then is the real `ray`."""
    from air.backends.ray_cluster import ray_executable, start_ray_node

    fake = tmp_path / "fake"
    fake.mkdir()
    script = fake / "ray"
    script.write_text(f"""#!/bin/sh
count=$(($(cat {fake}/starts 2>/dev/null || echo 0) + 1))
echo $count > {fake}/starts
if [ $count -le 1 ]; then
  sleep 300 >/dev/null 2>&1 &
  echo $! > {fake}/partial
  echo "{RAY_TIMEOUT}" >&2
  exit 1
fi
exec {shlex.join(ray_executable())} "$@"
""")
    script.chmod(0o755)
    node = start_ray_node(head=True, num_cpus=1, object_store_memory=80 * 1024 * 1024, executable=[str(script)])
    try:
        assert (fake / "starts").read_text().strip() == "2"
        assert "trying again (2 of 3)" in capsys.readouterr().out
        assert not alive([int((fake / "partial").read_text())])  # the failed try's partial node was ended
        assert node.processes()
    finally:
        node.stop()
    assert not node.processes()
