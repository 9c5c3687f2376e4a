"""`RayMetricsMonitor()` with no arguments in a workload whose node command starts Ray through air's `ray`
shim (as seed 000's does, and seed 001's document uses the monitor): Ray's metrics reach the run's MLflow run.
The shim records the metrics export port it gave `ray start` in the node's RAY_TMPDIR; the monitor finds
it there, its run in MLFLOW_RUN_ID (once `import mlflow` has it, air/tracking/node_hook.py), and that it
runs on the head from the shim's record."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from air.backends.ray_agent import tagged_processes_any_node
from air.store.paths import RunPaths, process_tag
from air.store.run_store import RunStore
from air.store.states import RunStatus
from proc_helpers import mlflow_run_ended, tracking_done

pytestmark = pytest.mark.ray

COMMAND = r"""
set -euo pipefail
ray start --head --num-cpus=1 --object-store-memory=80000000 --include-dashboard=false
python - <<'PY'
import time
from serverless_gpu.ray import RayMetricsMonitor
monitor = RayMetricsMonitor()  # before ray.init: the port comes from the shim, not from Ray
monitor.start()
import ray
ray.init(address="auto")

@ray.remote
def square(x):
    time.sleep(0.1)
    return x * x

def cluster_families_exported():  # Ray exports the cluster-wide families some seconds after the node's own
    return any(k.startswith("system/ray/ray_") for k in monitor.sample())

deadline = time.time() + 180
while (monitor.samples_logged < 1 or not cluster_families_exported()) and time.time() < deadline:
    ray.get([square.remote(i) for i in range(4)])
monitor.finish()  # (its last sample holds the cluster's families too)
print("samples:", monitor.samples_logged, "error:", monitor.last_error, "head:", monitor.is_head_node)
PY
ray stop
"""


def test_ray_metrics_monitor_with_no_arguments_logs_to_the_workload_run(air_home: Path, tmp_path: Path) -> None:
    import mlflow
    import yaml as pyyaml

    from air.tracking import prepare_store

    workload = tmp_path / "w.yaml"
    workload.write_text(pyyaml.safe_dump({
        "experiment_name": "ray-metrics-monitor-defaults", "command": COMMAND, "max_retries": 0,
        "compute": {"num_accelerators": 1, "accelerator_type": "CPU_1xCPU"}}))
    done = subprocess.run([sys.executable, "-m", "air.cli.main", "run", "-f", str(workload), "--watch"],
                          capture_output=True, text=True, timeout=400, env={**os.environ, "AIR_HOME": str(air_home)})
    run = RunStore().list_runs(statuses="all", limit=1)[0]
    log = RunPaths(run.id).node_log(0, 0).read_text()
    assert done.returncode == 0 and run.status is RunStatus.SUCCESS, (run, done.stdout, done.stderr, log)
    assert "samples:" in log and int(log.split("samples:")[1].split()[0]) >= 1, log
    assert "head: True" in log, log
    tracking_done(run.id)
    run = RunStore().get_run(run.id)
    uri = f"sqlite:///{air_home / 'mlflow.db'}"
    prepare_store(uri)
    record = mlflow_run_ended(mlflow.MlflowClient(uri), str(run.mlflow_run_id), air_run_id=run.id)
    keys = sorted(record.data.metrics)
    assert any(k.startswith("system/ray/node_0/") for k in keys), keys  # this node's families
    assert any(k.startswith("system/ray/ray_") for k in keys), keys  # the cluster's, logged by the head
    assert tagged_processes_any_node(process_tag(run.id)) == []
