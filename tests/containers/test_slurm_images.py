"""`environment.docker_image` on a real 2-node Slurm cluster (issue 38): each node of the job runs its command
in the workload's image (air's node launcher starts podman there; a node without the image pulls it by its
digest), with the image's own Python on both nodes and their rendezvous variables; cancel leaves no container,
no process and no job."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from container_helpers import containers_of, image_python

sys.path[:0] = [str(Path(__file__).parents[1] / "workload_runs"), str(Path(__file__).parents[1] / "slurm")]

from runs_helpers import air, wait_status, wait_terminal, write_workload  # noqa: E402
from slurm_cluster import SlurmCluster, shared_cluster  # noqa: E402

from air.environments.containers import RUN_LABEL  # noqa: E402
from air.store.paths import RunPaths, process_tag  # noqa: E402

pytestmark = pytest.mark.timeout(1800)  # (a fresh machine builds the image first)

PROBE = ("python3 -c \"import os, sys; print('IMAGE-PYTHON', '%d.%d.%d' % sys.version_info[:3], sys.executable, "
         "'node', os.environ['NODE_RANK'], 'master', os.environ['MASTER_ADDR'], os.environ['MASTER_PORT'])\"")


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    with shared_cluster("air-slurm-img-") as started:
        yield started


@pytest.fixture
def hpc(cluster: SlurmCluster, air_home: Path, monkeypatch: pytest.MonkeyPatch) -> SlurmCluster:
    cluster.idle()
    monkeypatch.setenv("SLURM_CONF", str(cluster.conf))
    air_home.mkdir(parents=True, exist_ok=True)
    (air_home / "config.yaml").write_text("default_profile: hpc\nprofiles:\n  hpc: {backend: slurm, partition: debug}\n")
    return cluster


def workload(tmp_path: Path, url: str, command: str) -> Path:
    return write_workload(tmp_path / "w", "img", f"""\
        experiment_name: slurm-in-image
        compute: {{accelerator_type: CPU_1xCPU, num_accelerators: 2}}
        max_retries: 0
        command: |
          {command}
        environment:
          docker_image: {{url: "{url}"}}
        """)


def run_id_of(result: object) -> str:
    assert result.returncode == 0, result.stderr + result.stdout  # type: ignore[attr-defined]
    return str(json.loads(result.stdout)["data"]["run_id"])  # type: ignore[attr-defined]


def test_both_slurm_nodes_run_in_the_image(hpc: SlurmCluster, tmp_path: Path, base_url: str, base_image: str) -> None:
    expected = image_python(base_image)
    assert expected != ".".join(str(p) for p in sys.version_info[:3])  # (the image's Python, not this one)
    run_id = run_id_of(air("run", "-f", str(workload(tmp_path, base_url, PROBE)), "--json", timeout=600))
    run = wait_terminal(run_id, timeout=300)
    logs = {n: RunPaths(run_id).node_log(0, n).read_text(errors="replace") for n in (0, 1)}
    assert run.status.value == "SUCCESS", (run.termination_reason, logs)
    masters = set()
    for node, log in logs.items():
        line = next(ln for ln in log.splitlines() if "IMAGE-PYTHON" in ln)
        assert f"IMAGE-PYTHON {expected} /usr/bin/python3 node {node} master" in line, line
        masters.add(line.split("master", 1)[1])
    assert len(masters) == 1  # both nodes have the same rendezvous
    assert containers_of(RUN_LABEL, run_id) == []
    hpc.idle(timeout=60)  # the job ended (past Slurm's COMPLETING)


def test_cancel_of_a_slurm_run_in_an_image_leaves_no_container_process_or_job(hpc: SlurmCluster, tmp_path: Path,
                                                                              base_url: str) -> None:
    run_id = run_id_of(air("run", "-f", str(workload(tmp_path, base_url, "echo STARTED $NODE_RANK; exec sleep 300")),
                           "--json", timeout=600))
    wait_status(run_id, "RUNNING", timeout=300)
    deadline = time.monotonic() + 180
    while not all(f"STARTED {n}" in _log(run_id, n) for n in (0, 1)):
        assert time.monotonic() < deadline, (_log(run_id, 0), _log(run_id, 1))
        time.sleep(0.2)
    assert len(containers_of(RUN_LABEL, run_id)) == 2
    assert air("cancel", run_id, "--yes").returncode == 0
    assert wait_terminal(run_id, timeout=180).status.value == "CANCELED"
    deadline = time.monotonic() + 60
    while containers_of(RUN_LABEL, run_id) or _tagged(process_tag(run_id)) or \
            hpc.tool("squeue", "-h", "-t", "PENDING,RUNNING,CONFIGURING", "-o", "%i").stdout.split():
        assert time.monotonic() < deadline, (containers_of(RUN_LABEL, run_id), _tagged(process_tag(run_id)),
                                             hpc.tool("squeue").stdout)
        time.sleep(0.2)


def _log(run_id: str, node: int) -> str:
    path = RunPaths(run_id).node_log(0, node)
    return path.read_text(errors="replace") if path.exists() else ""


def _tagged(tag: str) -> list[int]:
    """Processes whose environment carries the run's tag or a subtag of it (a node's)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                variables = (proc / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(v == f"AIR_PROCESS_TAG={tag}".encode() or v.startswith(f"AIR_PROCESS_TAG={tag}.".encode())
                   for v in variables):
                found.append(int(proc.name))
    return found
