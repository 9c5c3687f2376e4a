"""The README's workload example: 2 nodes, each running torchrun from the code snapshot."""

from __future__ import annotations

from pathlib import Path

from runs_helpers import air

from air.store.paths import RunPaths
from air.store.run_store import RunStore

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "workloads" / "torchrun_ddp" / "workload.yaml"


def test_two_node_torchrun_example_succeeds_with_a_log_per_node() -> None:
    result = air("run", "-f", str(EXAMPLE), "--watch", timeout=300)
    assert result.returncode == 0, result.stderr + result.stdout
    assert "epoch 2: loss" in result.stdout
    run = RunStore().list_runs(statuses="all")[0]
    assert run.status.value == "SUCCESS" and run.num_nodes == 2
    logs = RunPaths(run.id).node_logs(run.current_attempt)
    assert sorted(logs) == [0, 1]
    assert "epoch 0: loss" in logs[0].read_text()
    assert logs[1].stat().st_size >= 0
    code = Path(RunPaths(run.id).folder / "code")
    assert (next(code.iterdir()) / "train.py").exists()
