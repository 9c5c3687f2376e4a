"""What the lean install holds: MLflow's client and SQLite store without the UI server's heavy stack, and
the embedded store working on it through the real CLI."""

from __future__ import annotations

import importlib.util
import sys
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workload_runs"))
from runs_helpers import air, submit, wait_terminal, write_workload

from proc_helpers import mlflow_run_ended

#: What the full `mlflow` distribution pulls in (~500 MB) and the lean install must not.
HEAVY = ("pandas", "scipy", "sklearn", "pyarrow", "matplotlib")


def test_lean_install_has_mlflow_skinny_and_none_of_the_ui_stack() -> None:
    installed = {d.metadata["Name"].lower() for d in metadata.distributions()}
    assert "mlflow-skinny" in installed and "mlflow" not in installed, (
        "tests/lean run on the lean venv (`make test-lean`)"
    )
    assert {"sqlalchemy", "alembic"} <= installed
    assert [name for name in HEAVY if importlib.util.find_spec(name) is not None] == []


def test_workload_run_is_tracked_in_the_embedded_store_on_skinny(tmp_path: Path, air_home: Path) -> None:
    path = write_workload(
        tmp_path,
        "lean",
        """
        experiment_name: lean-exp
        compute: {num_accelerators: 1, accelerator_type: CPU_1xCPU}
        max_retries: 0
        parameters: {lr: 0.5}
        command: |
          python -c "import mlflow; mlflow.log_metric('loss', 0.25, step=1)"
          echo trained on skinny
        """,
    )
    run = wait_terminal(submit(path), timeout=180)
    assert run.status.value == "SUCCESS", run.termination_reason
    shown = air("get", "run", run.id)
    assert shown.returncode == 0 and "http://127.0.0.1:5000/#/experiments/" in shown.stdout, shown.stdout

    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{air_home / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("lean-exp")
    assert experiment is not None
    (found,) = client.search_runs([experiment.experiment_id])
    record = mlflow_run_ended(client, found.info.run_id)  # (ended right after the run's SUCCESS)
    assert record.info.status == "FINISHED" and record.data.params["lr"] == "0.5"
    assert [m.value for m in client.get_metric_history(record.info.run_id, "loss")] == [0.25]
