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
def test_ray_launch_runs_ray_train_on_the_cluster_it_starts_and_reports_to_the_callers_mlflow_run(
        air_home: Path, tmp_path: Path) -> None:
    """The example as a user in an MLflow run calls it (MLFLOW_TRACKING_URI and MLFLOW_RUN_ID set): Ray Train's
    2 workers train on the cluster ray_launch started (2 CPU slots), the call returns [driver's value, None],
    every `ray.train.report` lands in the caller's run as a metric and Ray's own metrics beside them
    (RayMetricsMonitor, on by default), and nothing of the call is left."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("ray-launch-seed001")).info.run_id
    result = python(SEED001 / "ray_launch_mlp.py", "--cpu", "2", "--only", "train", "--epochs", "2",
                    "--samples", "128", timeout=400,
                    env={"MLFLOW_TRACKING_URI": uri, "MLFLOW_RUN_ID": run_id,
                         "RAY_STORAGE_PATH": str(tmp_path / "ray_results")})
    assert result.returncode == 0, tail(result.stdout, 80)
    assert "OK: Ray Train ran 2 worker(s) on the cluster ray_launch started." in result.stdout
    assert "'total_loss'" in result.stdout and ", None]" in result.stdout  # [driver's value, None]
    assert "'resources': {'CPU': 2.0}" in result.stdout, tail(result.stdout)
    assert [m.step for m in client.get_metric_history(run_id, "total_loss")] == [0, 1]  # ray.train.report
    keys = client.get_run(run_id).data.metrics
    assert any(k.startswith("system/ray/") for k in keys), sorted(keys)  # RayMetricsMonitor
    assert list((tmp_path / "ray_results").glob("ray-launch-mlp-*/checkpoint_*/model.pt"))  # each report's
    assert not processes_with_env("AIR_CALL_DIR", lambda v: v.startswith(str(air_home)))


def test_distributed_mlp_on_cpu_takes_a_small_batch_and_shows_its_progress(
        air_home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Without --batch-size, CPU ranks take a batch of 32 (the document's 1 is for GPUs: 2,500 steps per
    rank per epoch, minutes on a small machine) and say so; rank 0 shows a progress bar over the steps."""
    monkeypatch.syspath_prepend(str(SEED001))
    monkeypatch.setenv("PYTHONPATH", str(SEED001))
    import train_mlp

    monkeypatch.setattr(sys, "argv", ["train_mlp.py", "--cpu", "2", "--epochs", "1", "--samples", "640"])
    results = train_mlp.main()
    del sys.modules["train_mlp"]

    assert [r["rank"] for r in results] == [0, 1]
    out = capsys.readouterr().out
    assert "CPU ranks: batch size 32 (the document's 1 is for GPUs: --batch-size 1 for it)" in out
    # 640 samples / 2 ranks / 32 per batch = 10 steps: a line at each tenth, only from rank 0.
    bars = [line for line in out.splitlines() if " epoch 1/1 [" in line]
    assert [line.split("] step ")[1].split()[0] for line in bars] == [f"{i}/10" for i in range(1, 11)], bars
    assert all(line.startswith("[rank 0] ") for line in bars)
    assert "[rank 0] epoch 1/1 [####################] step 10/10 loss " in out

    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{air_home / 'mlflow.db'}")
    logged = [len(client.get_metric_history(run.info.run_id, "loss"))
              for experiment in client.search_experiments()
              for run in client.search_runs([experiment.experiment_id])]
    assert [count for count in logged if count] == [20], logged  # 10 steps, 2 ranks
