"""Seed 000's workload, unchanged, on a real 2-node Slurm cluster (issue 37): its command starts Ray by hand
(`ray start --head` on node 0, `ray start --address=$MASTER_ADDR:6379 --block` on node 1) and trains with Ray
Train across both. air's `ray` shim goes with it on Slurm as on the other backends: node 0's reserved head
port, one auth token, each node's own RAY_TMPDIR, and `ray stop` ending this run's Ray only (Ray's own stops
every Ray of the machine)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from slurm_cluster import SlurmCluster
from test_slurm_runs import no_leftover

from air.store.paths import RunPaths
from air.store.run_store import RunStore
from proc_helpers import mlflow_run_ended

SEED000 = Path(__file__).resolve().parents[2] / "examples" / "seed000_ray_train_llm"


@pytest.mark.ray  # a Ray cluster: `make test` runs it in its Ray phase
@pytest.mark.timeout(900)  # a Ray cluster inside a Slurm job on 2 busy cores
def test_seed000_workload_runs_unchanged_on_slurm(hpc: SlurmCluster, air_home: Path, tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "air.cli.main", "run", "-f", str(SEED000 / "train_cpu.yaml"),
                             "--watch", "--json"], capture_output=True, text=True, timeout=800,
                            env={**os.environ, "HF_HOME": str(tmp_path / "hf")})
    events = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    log = [e["line"] for e in events if e.get("type") == "LOG"]
    assert result.returncode == 0, "\n".join(log[-60:]) + result.stderr[-2000:]
    assert events[-1]["type"] == "TERMINAL" and events[-1]["status"] == "SUCCESS"
    run = RunStore().get_run(events[0]["run_id"])
    assert run.backend == "slurm" and run.num_nodes == 2
    losses = [float(x) for x in re.findall(r"step \d+: loss ([0-9.]+)", "\n".join(log))]
    assert len(losses) == 12 and losses[-1] < losses[0] * 0.9, losses
    logs = RunPaths(run.id).node_logs(run.current_attempt)
    assert sorted(logs) == [0, 1]
    assert "the head node stopped; stopping this node" in logs[1].read_text()  # the shim's joining node
    assert "ray stop: ended this node's Ray" in logs[0].read_text()  # this run's Ray only
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{air_home / 'mlflow.db'}")
    ended = mlflow_run_ended(client, str(run.mlflow_run_id), air_run_id=run.id)
    assert ended.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(ended.info.run_id, "train_loss")] == list(range(1, 13))
    no_leftover(hpc, timeout=60)
    assert not Path(f"/tmp/air-seed000-{run.id}").exists()
