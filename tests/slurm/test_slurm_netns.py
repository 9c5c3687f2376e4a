"""Each slurmd in its own network namespace with its own address: node-to-node traffic (the rendezvous, the
logs, MLflow) crosses a real interface, so no loopback shortcut hides a wrong address (issue 37)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from slurm_cluster import SlurmCluster
from test_slurm_runs import EXAMPLE, no_leftover

from air.backends.slurm import read_state
from air.store.paths import RunPaths
from air.store.run_store import RunStore


@pytest.mark.timeout(900)  # minutes on 2 busy cores (torch's import)
def test_two_node_ddp_across_namespaces(hpc_netns: SlurmCluster) -> None:
    result = subprocess.run([sys.executable, "-m", "air.cli.main", "run", "-f", str(EXAMPLE), "--watch"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr + result.stdout
    assert "epoch 2: loss" in result.stdout
    run = RunStore().list_runs(statuses="all")[0]
    assert run.status.value == "SUCCESS" and run.num_nodes == 2
    assert read_state(run.id) is not None
    jobs = sorted((RunPaths(run.id).folder / "slurm").iterdir())
    hosts = [json.loads((jobs[-1] / f"node_{n}" / "host.json").read_text()) for n in (0, 1)]
    # each node reached the others at its own namespace's address, node 0's being MASTER_ADDR
    assert [h["addr"] for h in hosts] == [hpc_netns.addresses["n1"], hpc_netns.addresses["n2"]]
    assert not any(h["addr"].startswith("127.") for h in hosts)
    logs = RunPaths(run.id).node_logs(run.current_attempt)
    assert "epoch 0: loss" in logs[0].read_text() and logs[1].exists()
    no_leftover(hpc_netns)
