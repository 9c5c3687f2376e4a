"""`@distributed(remote=True)` under a slurm profile: one Slurm job of N nodes, every rank's value returned."""

from __future__ import annotations

from slurm_cluster import SlurmCluster
from test_slurm_runs import no_leftover

from air import distributed
from air.store.run_store import RunStore


def test_remote_call_returns_every_ranks_value(hpc: SlurmCluster) -> None:
    @distributed(num_accelerators=2, accelerator_type="CPU_1xCPU", remote=True)
    def where() -> tuple[int, str, str]:
        import os

        return int(os.environ["RANK"]), os.environ["NODE_RANK"], os.environ.get("SLURM_JOB_ID", "")

    values = where.distributed()
    assert [v[:2] for v in values] == [(0, "0"), (1, "1")]
    assert values[0][2] and values[0][2] == values[1][2]  # both ranks in one Slurm job
    run = RunStore().list_runs(statuses="all")[0]
    assert run.status.value == "SUCCESS" and run.backend == "slurm" and run.kind == "call"
    no_leftover(hpc)
