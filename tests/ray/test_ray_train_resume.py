"""Ray Train resumes a retried attempt from its checkpoints: a 2-node workload on this machine starts its
own Ray cluster (seed 000's command: `ray start --head` on node 0, `ray start --address=... --block` on
node 1) and runs a TorchTrainer with 2 workers that sets no storage_path. Attempt 0 checkpoints 3 steps
and crashes; attempt 1's workers get the last checkpoint from `ray.train.get_checkpoint()`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from air.backends.ray_agent import tagged_processes_any_node
from air.store.paths import RunPaths, process_tag
from air.store.run_store import RunStore
from air.store.states import RunStatus

pytestmark = pytest.mark.ray

HERE = Path(__file__).parent

COMMAND = r"""
set -euo pipefail
if [ "$NODE_RANK" = "0" ]; then
  ray start --head --port=6379 --num-cpus=2 --object-store-memory=80000000 --include-dashboard=false
  trap 'ray stop' EXIT
  python {script}
else
  for i in $(seq 1 12); do
    if ray start --address="$MASTER_ADDR:6379" --num-cpus=1 --object-store-memory=80000000 --block 2>/dev/null; then
      break
    fi
    echo "Attempt $i failed, retrying in 5s..."
    sleep 5
  done
fi
"""


@pytest.mark.timeout(900)  # two attempts of a Ray cluster on 2 cores shared with other test workers
def test_a_retried_ray_train_run_resumes_from_its_last_checkpoint(ray_cluster, air_home: Path, tmp_path: Path) -> None:
    workload = tmp_path / "w.yaml"
    workload.write_text(yaml.safe_dump({
        "experiment_name": "ray-train-resume", "max_retries": 1,
        "command": COMMAND.format(script=HERE / "ray_train_resume.py"),
        "compute": {"num_accelerators": 2, "accelerator_type": "CPU_1xCPU"},
        "env_variables": {"RAY_ADDRESS": ray_cluster.address}}))  # the command's own cluster, not this one
    proc = subprocess.run([sys.executable, "-m", "air.cli.main", "run", "-f", str(workload), "--watch"],
                          capture_output=True, text=True, timeout=840, env={**os.environ, "AIR_HOME": str(air_home)})
    run = RunStore().list_runs(statuses="all", limit=1)[0]
    paths = RunPaths(run.id)
    first, second = paths.node_log(0, 0).read_text(), paths.node_log(1, 0).read_text()
    assert proc.returncode == 0 and run.status is RunStatus.SUCCESS, (run, first[-3000:], second[-3000:])
    assert "attempt 0 resumed=0 reached step 3" in first and "simulated crash" in first, first[-3000:]
    assert "worker 0 starts at step 3" in second and "worker 1 starts at step 3" in second, second[-3000:]
    assert "attempt 1 resumed=1 reached step 6" in second, second[-3000:]
    assert f"storage {paths.checkpoints()}/air-{run.id}" in second  # the run's checkpoint folder, no storage_path
    assert tagged_processes_any_node(process_tag(run.id)) == []
