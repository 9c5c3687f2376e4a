"""MLflow's usage telemetry is off in a run's nodes unless the user chose (as Ray's usage stats are): on an
offline machine its config thread pops a variable from `os.environ` while MLflow's async logging thread copies
`os.environ`, and a node's metric batch failed with KeyError (MLflow 3). Real `air run` processes, the
embedded MLflow store."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from air.store.paths import RunPaths
from air.store.run_store import RunStore
from proc_helpers import tracking_done

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workload_runs"))
from runs_helpers import submit, wait_terminal, write_workload

PRINTS = """
    experiment_name: telemetry-exp
    compute: {num_accelerators: 1, accelerator_type: CPU_1xCPU}
    command: |
      echo "TELEMETRY=${MLFLOW_DISABLE_TELEMETRY:-unset} DNT=${DO_NOT_TRACK:-unset}"
"""


@pytest.mark.timeout(600)  # three supervisors on 2 busy cores
@pytest.mark.parametrize(("callers", "seen"), [
    ({}, "TELEMETRY=true DNT=unset"),  # air's default
    ({"MLFLOW_DISABLE_TELEMETRY": "false"}, "TELEMETRY=false DNT=unset"),  # the user's choice is kept
    ({"DO_NOT_TRACK": "1"}, "TELEMETRY=unset DNT=1"),  # MLflow's other switch: air adds nothing
])
def test_nodes_run_with_mlflows_telemetry_off_unless_the_user_chose(
        tmp_path: Path, air_home: Path, monkeypatch: pytest.MonkeyPatch, callers: dict[str, str], seen: str) -> None:
    for key in ("MLFLOW_DISABLE_TELEMETRY", "DO_NOT_TRACK"):  # (the suite turns it off for its own processes)
        monkeypatch.delenv(key, raising=False)
    for key, value in callers.items():
        monkeypatch.setenv(key, value)
    run_id = submit(write_workload(tmp_path, "telemetry", PRINTS))
    run = wait_terminal(run_id, timeout=300)
    assert run.status.value == "SUCCESS", run.termination_reason
    tracking_done(run_id)
    assert RunStore().get_run(run_id).mlflow_run_id, "the run was tracked (the default lies in its tracking env)"
    assert seen in RunPaths(run_id).node_log(0, 0).read_text()


CALL = """import os
from air import distributed

@distributed(gpus=1, accelerator_type="CPU")
def telemetry():
    return os.environ.get("MLFLOW_DISABLE_TELEMETRY", "unset")

print("RANKS", telemetry.distributed())
"""


@pytest.mark.timeout(600)
def test_a_calls_ranks_run_with_mlflows_telemetry_off(tmp_path: Path, air_home: Path) -> None:
    """The same default for a tracked `@distributed` call's ranks (the call's run is made lazily)."""
    import os
    import subprocess

    script = tmp_path / "call.py"
    script.write_text(CALL)
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_DISABLE_TELEMETRY", "DO_NOT_TRACK")}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RANKS ['true']" in done.stdout, done.stdout + done.stderr[-3000:]
