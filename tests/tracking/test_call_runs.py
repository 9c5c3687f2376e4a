"""`@distributed` call runs, made in the caller's process like a notebook would.

The caller's MLflow state (active run, active experiment, environment) must be untouched afterwards;
the call run nests under an active run and lands in the experiment the caller chose.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from air.tracking import DEFAULT_CALL_EXPERIMENT, artifact_root, start_call_run, tracking_uri

RANK_PROGRAM = "import mlflow; mlflow.log_metric('rank_loss', 0.5, step=1)"


@pytest.fixture
def fluent_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """Undo what `mlflow.set_experiment` does to this process (a global and an env variable)."""
    from mlflow.tracking import fluent

    monkeypatch.setattr(fluent, "_active_experiment_id", None)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", "")  # recorded, so teardown removes what MLflow sets
    monkeypatch.delenv("MLFLOW_EXPERIMENT_ID")


def test_call_run_nested_under_the_callers_active_run(
    fluent_state: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri())
    mlflow.set_experiment("notebook-experiment")
    warnings: list[str] = []
    with mlflow.start_run(run_name="notebook") as parent:
        env_before = dict(os.environ)
        handle = start_call_run("train", {"air.call_id": "c-1"}, warn=warnings.append)
        assert handle is not None, warnings
        assert mlflow.active_run().info.run_id == parent.info.run_id
        assert dict(os.environ) == env_before

        rank = subprocess.run(
            [sys.executable, "-c", RANK_PROGRAM],
            env={"PATH": os.environ["PATH"], **handle.env()},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert rank.returncode == 0, rank.stderr
        log = tmp_path / "rank.out"
        log.write_text("rank 0 says hi\n")
        assert handle.log_rank_log(log, rank=0)
        assert handle.end("FINISHED")
        assert mlflow.active_run().info.run_id == parent.info.run_id

    client = mlflow.MlflowClient(tracking_uri())
    child = client.get_run(handle.run_id)
    assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert child.data.tags["air.call_id"] == "c-1"
    assert child.info.run_name == "train"
    assert child.info.experiment_id == parent.info.experiment_id
    assert child.info.status == "FINISHED"
    assert child.data.metrics["rank_loss"] == 0.5
    assert [f.path for f in client.list_artifacts(handle.run_id, "logs")] == ["logs/rank_0.log"]
    assert client.get_experiment(handle.experiment_id).tags["air-show-logs"] == "true"
    assert client.get_run(parent.info.run_id).info.status == "FINISHED"  # ended by its own `with`
    assert warnings == []


def test_call_run_without_mlflow_setup_goes_to_the_default_experiment(fluent_state: None) -> None:
    import mlflow

    handle = start_call_run("train", {})
    assert handle is not None
    assert mlflow.active_run() is None
    assert handle.tracking_uri == tracking_uri()
    assert handle.end("KILLED")
    client = mlflow.MlflowClient(tracking_uri())
    exp = client.get_experiment(handle.experiment_id)
    assert exp.name == DEFAULT_CALL_EXPERIMENT
    assert exp.artifact_location.startswith(artifact_root().as_uri())
    run = client.get_run(handle.run_id)
    assert "mlflow.parentRunId" not in run.data.tags
    assert run.info.status == "KILLED"


def test_call_run_uses_mlflow_experiment_name(monkeypatch: pytest.MonkeyPatch) -> None:
    import mlflow

    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from-env")
    handle = start_call_run("train", {})
    assert handle is not None and handle.end("FINISHED")
    assert mlflow.MlflowClient(tracking_uri()).get_experiment(handle.experiment_id).name == "from-env"
