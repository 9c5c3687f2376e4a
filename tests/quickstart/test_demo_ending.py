"""`make demo`'s script ends by telling where its logs and MLflow run went, and the commands to see them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "quickstart" / "ddp_cpu.py"


def test_demo_ends_with_where_things_went(air_home: Path) -> None:
    air_home = air_home.resolve()
    # As `make demo` runs it: from the checkout, AIR_HOME set to a folder inside it (here the test's own).
    result = subprocess.run(
        [sys.executable, str(DEMO), "--epochs", "1"],
        cwd=ROOT,
        env={**os.environ, "AIR_HOME": str(air_home)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ending = result.stdout[result.stdout.index("Where things went") :]

    logs = re.search(r"rank logs:\s+(\S+)/rank_<N>\.log", ending)
    assert logs, ending
    call_dir = Path(logs.group(1))
    assert call_dir.name == "attempt_0" and call_dir.parent.parent == air_home / "runs"  # runs/<id>/attempt_0
    assert "epoch 0: loss" in (call_dir / "rank_0.log").read_text()

    run = re.search(r"MLflow run:\s+([0-9a-f]{32}) \(experiment 'air-distributed'\) in (\S+)", ending)
    assert run, ending
    assert run.group(2) == f"sqlite:///{air_home / 'mlflow.db'}"
    from mlflow import MlflowClient

    assert MlflowClient(run.group(2)).get_run(run.group(1)).info.status == "FINISHED"

    air = Path(sys.executable).parent / "air"
    shown_air = os.path.relpath(air, ROOT) if air.is_relative_to(ROOT) else str(air)
    assert f"AIR_HOME={air_home} {shown_air} list runs" in ending
    assert f"AIR_HOME={air_home} {shown_air} ui" in ending
    run_id = call_dir.parent.name  # a call's run folder is named by its run id, which `air logs` takes
    assert f"AIR_HOME={air_home} {shown_air} logs {run_id} --rank 0" in ending
    assert "/#/experiments/" in ending and run.group(1) in ending  # the run's link in the UI
    assert f"source {Path(shown_air).parent / 'activate'}" in ending
