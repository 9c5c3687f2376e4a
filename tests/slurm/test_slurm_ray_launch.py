"""`@ray_launch(remote=True)` under a slurm profile (issue 37): Ray's own pattern on Slurm, a head and a worker
inside one Slurm job's allocation, the function run once as the driver on node 0; nothing of the cluster is left."""

from __future__ import annotations

import pytest
from slurm_cluster import SlurmCluster
from test_slurm_runs import no_leftover

from air.ray import ray_launch
from air.store.run_store import RunStore


@pytest.mark.ray  # a Ray cluster: `make test` runs it in its Ray phase
@pytest.mark.timeout(600)  # a Ray cluster inside a Slurm job on 2 busy cores
def test_ray_launch_makes_a_ray_cluster_of_the_jobs_nodes(hpc: SlurmCluster) -> None:
    @ray_launch(num_accelerators=2, accelerator_type="CPU_1xCPU", remote=True)
    def cluster() -> tuple[int, float, list[str]]:
        import os

        import ray

        ray.init()  # RAY_ADDRESS points at the call's own cluster

        @ray.remote(num_cpus=1)
        def job_of_a_task() -> str:
            return os.environ.get("SLURM_JOB_ID", "")

        nodes = [n for n in ray.nodes() if n["Alive"]]
        jobs = ray.get([job_of_a_task.remote() for _ in range(4)])
        return len(nodes), ray.cluster_resources().get("CPU", 0.0), jobs

    values = cluster.distributed()
    assert len(values) == 2 and values[1] is None  # the driver's value, then None for the other rank
    nodes, cpus, jobs = values[0]
    assert nodes == 2 and cpus >= 2.0, values[0]  # (each node advertises its machine's CPUs)
    run = RunStore().list_runs(statuses="all")[0]
    assert run.status.value == "SUCCESS" and run.backend == "slurm" and run.kind == "call"
    assert set(jobs) == {jobs[0]} and jobs[0], jobs  # every task ran inside the run's one Slurm job
    no_leftover(hpc, timeout=60)
