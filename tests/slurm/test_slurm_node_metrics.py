"""Each Slurm node samples its own host (issue 37): the node launcher's system metrics land in the attempt's
MLflow run as `system/node_<n>/...`, tagged with the host and Slurm node each ran on; the submitting side
(on another machine of a real cluster) samples nothing of its own for them."""

from __future__ import annotations

from pathlib import Path

import pytest
from slurm_cluster import SlurmCluster
from test_slurm_runs import no_leftover, submit, wait_for, workload

from air.store.run_store import RunStore
from proc_helpers import mlflow_run_ended

METRICS = ("cpu_utilization_percentage", "system_memory_usage_megabytes", "system_memory_usage_percentage")


@pytest.mark.timeout(600)
def test_each_slurm_node_logs_its_own_hosts_metrics_to_the_mlflow_run(hpc: SlurmCluster, air_home: Path,
                                                                     tmp_path: Path) -> None:
    run_id = submit(workload(tmp_path, "sleep 7"))
    wait_for(lambda: RunStore().get_run(run_id).status.is_terminal(), 300, "the run to end")
    run = RunStore().get_run(run_id)
    assert run.status.value == "SUCCESS", run.termination_reason
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{air_home / 'mlflow.db'}")
    record = mlflow_run_ended(client, str(run.mlflow_run_id), air_run_id=run.id)
    metrics, tags = record.data.metrics, record.data.tags
    for n, slurm_node in ((0, "n1"), (1, "n2")):
        for name in METRICS:
            assert f"system/node_{n}/{name}" in metrics, (n, name, sorted(metrics))
        assert tags[f"air.slurm_node.node_{n}"] == slurm_node, tags
        assert tags[f"air.host.node_{n}"] and tags[f"air.ip.node_{n}"], tags
        history = client.get_metric_history(record.info.run_id, f"system/node_{n}/cpu_utilization_percentage")
        assert len(history) >= 2, (n, len(history))  # sampled through the node's seconds of work
    no_leftover(hpc)
