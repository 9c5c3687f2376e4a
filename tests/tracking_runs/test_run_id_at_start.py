"""`MLFLOW_RUN_ID` for a node's command (issue 35): a node starts before its MLflow run exists (early start),
and still a bash command that reads `$MLFLOW_RUN_ID`, or Python code that reads `os.environ["MLFLOW_RUN_ID"]`
before any `import mlflow` (Lightning's `MLFlowLogger(run_id=os.environ.get("MLFLOW_RUN_ID"))`), gets the
attempt's run. Real `air run` processes, the real embedded MLflow store (frozen by its creation lock)."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from air.home import AirHome
from air.store.paths import RunPaths
from air.store.run_store import RunStore
from air.tracking.node_hook import write_env, write_hook
from proc_helpers import tracking_done, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workload_runs"))
from runs_helpers import submit, wait_terminal, write_workload

#: Python code of a node that reads the run's id before MLflow is imported (as Lightning's users do).
READER = """import os, sys
run_id = os.environ.get("MLFLOW_RUN_ID")
print("PY=" + str(run_id), "mlflow imported:", "mlflow" in sys.modules, flush=True)
"""


def _clean_env(**extra: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}, **extra}


def test_the_hook_and_the_prelude_hand_over_the_run_id_once_it_exists(tmp_path: Path) -> None:
    """Unit level (no air run): a Python read of MLFLOW_RUN_ID and a bash command that reads it wait for the
    run's variables, then see them; reading any other variable never waits."""
    from air.tracking.node_hook import prelude_of

    env_file = tmp_path / "attempt" / "mlflow_env.json"
    env_file.parent.mkdir()
    hook = write_hook(tmp_path / "attempt" / "mlflow_hook", env_file, wait_s=240)
    command = tmp_path / "command.sh"
    command.write_text('echo "RUN=$MLFLOW_RUN_ID EXP=$MLFLOW_EXPERIMENT_ID"\n')

    other = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('HOME') is not None)"],
                           env=_clean_env(PYTHONPATH=str(hook)), capture_output=True, text=True, timeout=120)
    assert other.returncode == 0 and other.stdout.strip() == "True" and other.stderr == "", other.stderr

    python = subprocess.Popen([sys.executable, "-c", READER], env=_clean_env(PYTHONPATH=str(hook)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    shell = subprocess.Popen(["bash", str(prelude_of(hook)), str(command)], env=_clean_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1.0)
        assert python.poll() is None and shell.poll() is None  # both wait: the run does not exist yet
        write_env(env_file, {"MLFLOW_RUN_ID": "abc123", "MLFLOW_EXPERIMENT_ID": "7"})
        py_out, py_err = python.communicate(timeout=120)
        sh_out, sh_err = shell.communicate(timeout=120)
    finally:
        for proc in (python, shell):
            if proc.poll() is None:
                proc.kill()
    assert python.returncode == 0 and py_out.split() == ["PY=abc123", "mlflow", "imported:", "False"], py_err
    assert "[air] waiting for its MLflow run (this process reads MLFLOW_RUN_ID)" in py_err
    assert shell.returncode == 0 and sh_out.strip() == "RUN=abc123 EXP=7", sh_err
    assert "[air] waiting for its MLflow run (the command reads MLFLOW_RUN_ID)" in sh_err

    # Once the file exists: no wait, no line; the command still runs under `bash -euo pipefail`.
    command.write_text('echo "RUN=$MLFLOW_RUN_ID"\nfalse\necho not reached\n')
    again = subprocess.run(["bash", str(prelude_of(hook)), str(command)], env=_clean_env(), capture_output=True,
                           text=True, timeout=120)
    assert again.returncode == 1 and again.stdout.strip() == "RUN=abc123" and again.stderr == "", again.stderr

    # No run at all (`{}`): the command goes on without one, and says so.
    write_env(env_file, {})
    command.write_text('echo "RUN=${MLFLOW_RUN_ID:-none}"\n')
    none = subprocess.run(["bash", str(prelude_of(hook)), str(command)], env=_clean_env(), capture_output=True,
                          text=True, timeout=120)
    assert none.returncode == 0 and none.stdout.strip() == "RUN=none"
    assert "MLFLOW_RUN_ID is not set" in none.stderr


@pytest.mark.timeout(900)  # waits for conditions only, each bounded generously (2 busy cores)
@pytest.mark.parametrize("reader", ["bash", "python"])
def test_a_node_that_reads_mlflow_run_id_before_its_run_exists_gets_the_attempts_run(
        tmp_path: Path, air_home: Path, monkeypatch: pytest.MonkeyPatch, reader: str) -> None:
    """MLflow is frozen (the test holds the embedded store's creation lock): the node starts at once, and its
    read of MLFLOW_RUN_ID waits, with a line in the node's log, until the run is made; it then prints the
    attempt's MLflow run id (the one `air get run` and tracking.json name). Without the fix: empty."""
    monkeypatch.setenv("AIR_TRACKING_EARLY_START", "on")
    script = tmp_path / "reader.py"
    script.write_text(READER)
    command = ('echo "RUN=$MLFLOW_RUN_ID"' if reader == "bash"
               else f"python {script}")  # (the command itself never names MLFLOW_RUN_ID)
    path = write_workload(tmp_path, f"reads-{reader}", f"""
        experiment_name: run-id-exp
        compute: {{num_accelerators: 1, accelerator_type: CPU_1xCPU}}
        command: |
          echo "node started"
          {command}
    """)
    lock_path = AirHome().mlflow_db_lock
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # MLflow frozen: the attempt's run cannot be made yet
        try:
            run_id = submit(path)
            paths = RunPaths(run_id)

            def log() -> str:
                node_log = paths.node_log(0, 0)
                return node_log.read_text() if node_log.exists() else ""

            wait_for(lambda: "waiting for its MLflow run" in log(), "the node's wait line while MLflow is frozen",
                     timeout=240)
            assert not paths.mlflow_env(0).exists() and "RUN=" not in log() and "PY=" not in log()
            if reader == "bash":
                assert "node started" not in log()  # (the command waits before its first line)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    run = wait_terminal(run_id, timeout=300)
    assert run.status.value == "SUCCESS", run.termination_reason
    tracking_done(run.id)
    mlflow_run_id = json.loads(paths.mlflow_env(0).read_text())["MLFLOW_RUN_ID"]
    assert mlflow_run_id and RunStore().get_run(run.id).mlflow_run_id == mlflow_run_id
    text = log()
    if reader == "bash":
        assert f"RUN={mlflow_run_id}" in text, text
    else:
        assert f"PY={mlflow_run_id} mlflow imported: False" in text, text
