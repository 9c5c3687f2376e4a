"""On the lean install (`pip install -e .`, no extras; `make test-lean`): `air ui` says what to install."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path


def test_air_ui_without_the_ui_extra_names_the_install_command(air_home: Path) -> None:
    assert "mlflow" not in {d.metadata["Name"].lower() for d in metadata.distributions()}, (
        "full mlflow is installed here: tests/lean run on the lean venv (`make test-lean`)"
    )
    result = subprocess.run(
        [sys.executable, "-m", "air.cli.main", "ui", "--port", "5999"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    (distribution,) = set(metadata.packages_distributions()["air"])  # the name pip knows air by
    assert f"pip install '{distribution}[ui]'" in result.stderr
    assert "MLflow's UI server" in result.stderr and "Traceback" not in result.stderr
    assert not (air_home / "mlflow.db").exists()  # nothing was created for a UI that cannot start
