"""Hang detection on the ray profile: each node's agent reports how long its processes have been quiet
(in its poll replies) and dumps their stacks on request."""

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
from air.store.states import FailureClass, RunStatus

pytestmark = pytest.mark.ray


def test_a_silent_node_on_ray_is_ended_as_hung_with_its_stacks(ray_cluster, air_home: Path, tmp_path: Path) -> None:
    ray_cluster.write_profile(air_home)
    workload = tmp_path / "w.yaml"
    workload.write_text(yaml.safe_dump({
        "experiment_name": "ray-hang", "max_retries": 0, "hang_timeout_minutes": 0.25,
        "compute": {"num_accelerators": 2, "accelerator_type": "CPU_1xCPU"},
        "command": 'if [ "$NODE_RANK" = 1 ]; then exec python -c "import time; time.sleep(600)"; fi\n'
                   "while true; do echo tick; sleep 1; done\n"}))
    proc = subprocess.run([sys.executable, "-m", "air.cli.main", "run", "-f", str(workload), "--watch"],
                          capture_output=True, text=True, timeout=240, env={**os.environ, "AIR_HOME": str(air_home)})
    run = RunStore().list_runs(statuses="all", limit=1)[0]
    assert proc.returncode == 1 and run.status is RunStatus.FAILED, (run, proc.stdout[-2000:], proc.stderr[-2000:])
    assert run.failure_class is FailureClass.HANG
    assert (run.termination_reason or "").startswith("Hang: node 1 made no progress for 1"), run.termination_reason
    stacks = RunPaths(run.id).stacks(0, "node 1").read_text()
    assert "time.sleep" in stacks or "<module>" in stacks, stacks
    assert tagged_processes_any_node(process_tag(run.id)) == []
