"""Seed 001: the document's MLP through `@distributed` on CPU ranks (gloo), its loss in MLflow, and the
`ray_launch` example (a Ray cluster per call, Ray Train on it)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from seed_helpers import SEED001, processes_with_env, python, tail


def test_distributed_mlp_returns_every_ranks_result_and_logs_loss(
        air_home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.syspath_prepend(str(SEED001))
    monkeypatch.setenv("PYTHONPATH", str(SEED001))  # the ranks import the example module, as the caller did
    import train_mlp

    # The document's decorator, kept as written; on a machine without a GPU the script runs the same
    # function on CPU ranks (gloo instead of NCCL, nothing else).
    assert (train_mlp.run_train.gpus, train_mlp.run_train.gpu_type, train_mlp.run_train.remote) == (8, "A10", True)
    monkeypatch.setattr(sys, "argv", ["train_mlp.py", "--cpu", "2", "--epochs", "2", "--samples", "128",
                                      "--batch-size", "16"])
    results = train_mlp.main()
    del sys.modules["train_mlp"]

    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["device"] == "cpu" and len(r["epoch_losses"]) == 2 for r in results)
    out = capsys.readouterr().out
    assert "[rank 1] Total loss for epoch 1:" in out and "OK: 2 rank(s) trained the MLP with DDP" in out

    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{air_home / 'mlflow.db'}")
    logged = [len(client.get_metric_history(run.info.run_id, "loss"))
              for experiment in client.search_experiments()
              for run in client.search_runs([experiment.experiment_id])]
    # 128 samples / 2 ranks / 16 per batch = 4 steps per epoch, 2 epochs, 2 ranks, one call run.
    assert [count for count in logged if count] == [16], logged


@pytest.mark.ray
@pytest.mark.timeout(600)  # a Ray cluster on 2 busy cores: minutes, not seconds
def test_ray_launch_runs_ray_train_on_the_cluster_it_starts(air_home: Path) -> None:
    result = python(SEED001 / "ray_launch_mlp.py", "--cpu", "2", "--only", "train", "--epochs", "1",
                    "--samples", "128", timeout=400)
    assert result.returncode == 0, tail(result.stdout, 80)
    assert "OK: Ray Train ran 2 worker(s) on the cluster ray_launch started." in result.stdout
    assert "'total_loss'" in result.stdout and ", None]" in result.stdout  # [driver's value, None]
    assert not processes_with_env("AIR_CALL_DIR", lambda v: v.startswith(str(air_home)))
