"""`air.runtime.ray_init()` (issue 26): inside a Ray workload it joins the run's own cluster (the one
its command started, beside any other Ray on the machine) and prints the dashboard's URL; outside one it
says so instead of starting a stray local Ray."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from air import ray_init as exported
from air.errors import RuntimeConfigurationError
from air.runtime import ray_init
from air.settings import AIR_RAY_HEAD_PORT
from air.store.paths import RunPaths
from air.store.run_store import RunStore
from air.store.states import RunStatus

pytestmark = pytest.mark.ray


def test_outside_a_ray_workload_it_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv(AIR_RAY_HEAD_PORT, raising=False)
    with pytest.raises(RuntimeConfigurationError, match="not in a Ray workload") as caught:
        ray_init()
    assert caught.value.hint is not None and "ray start --head" in caught.value.hint
    assert exported is ray_init
    import serverless_gpu.runtime

    assert serverless_gpu.runtime.ray_init is ray_init  # type: ignore[attr-defined]


def test_the_dashboard_url_is_a_link_other_nodes_can_follow() -> None:
    from air.runtime import _dashboard_url, get_node_ip

    assert _dashboard_url("127.0.0.1:37237") == "http://127.0.0.1:37237"
    assert _dashboard_url("0.0.0.0:8265") == f"http://{get_node_ip()}:8265"  # bound for the cluster: this node
    assert _dashboard_url("http://10.0.0.5:8265") == "http://10.0.0.5:8265"
    assert _dashboard_url("") is None and _dashboard_url(None) is None


def test_in_a_workload_it_joins_the_runs_own_cluster(air_home: Path, tmp_path: Path) -> None:
    """A real workload: its command starts Ray by hand (through air's `ray` shim); ray_init() finds that
    cluster (not another of this machine). The dashboard is left off: starting it on a loaded 2-core machine
    can outlast Ray's own 60 s start deadline; the URL it would print is checked above."""
    command = """
ray start --head --num-cpus=1 --object-store-memory=80000000 --include-dashboard=false
python - <<'PY'
import ray
from air.runtime import ray_init
context = ray_init()
print("gcs:", ray.get_runtime_context().gcs_address, "cpus:", ray.cluster_resources().get("CPU"))
PY
ray stop
"""
    workload = tmp_path / "w.yaml"
    workload.write_text(yaml.safe_dump({
        "experiment_name": "ray-init", "command": command, "max_retries": 0,
        "compute": {"num_accelerators": 1, "accelerator_type": "CPU_1xCPU"}}))
    proc = subprocess.run([sys.executable, "-m", "air.cli.main", "run", "-f", str(workload), "--watch"],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "AIR_HOME": str(air_home), "AIR_TRACKING": "off"})
    run = RunStore().list_runs(statuses="all", limit=1)[0]
    log = RunPaths(run.id).node_log(0, 0).read_text()
    assert proc.returncode == 0 and run.status is RunStatus.SUCCESS, (proc.stdout, proc.stderr, log)
    assert "Ray dashboard: none (the head was started without one)" in log, log
    assert "cpus: 1.0" in log  # its own one-CPU head, not another cluster of this machine
    head_port = next(line for line in log.splitlines() if "GCS port" in line).split("->")[1].split()[0]
    assert f"gcs: 127.0.0.1:{head_port}" in log or f":{head_port} cpus" in log, log
