"""Shared fixtures: every test gets its own AIR_HOME, and a way to prove no process survived."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def air_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "air-home"
    monkeypatch.setenv("AIR_HOME", str(home))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_ID", raising=False)  # mlflow.set_experiment() exports it
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    monkeypatch.delenv("AIR_PROFILE", raising=False)
    # Anything a test (or MLflow, with its ./mlruns default) writes to the current folder lands here.
    work = tmp_path / "cwd"
    work.mkdir(exist_ok=True)
    monkeypatch.chdir(work)
    return home


@pytest.fixture
def pid_dir(tmp_path: Path) -> Path:
    path = tmp_path / "pids"
    path.mkdir()
    return path


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("AIR_CPU_SLOTS", "8")
