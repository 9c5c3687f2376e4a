"""Tracking off the start path (issue 24): a node starts before its MLflow run exists and still logs
into it; one system-metrics sampler for every local node; air's tracking lines in supervisor.log only.
Real `air run` processes, the real embedded MLflow store."""

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
from proc_helpers import mlflow_run_ended, tracking_done, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workload_runs"))
from runs_helpers import submit, wait_terminal, write_workload


def _client(air_home: Path):
    import mlflow

    from air.tracking import prepare_store

    uri = f"sqlite:///{air_home}/mlflow.db"
    prepare_store(uri)
    return mlflow.MlflowClient(uri)


def _python(code: str, hook: Path, extra_path: str = "", timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(hook), extra_path) if p)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)


def test_the_hook_holds_only_a_real_import_of_mlflow_and_keeps_the_sites_own_sitecustomize(tmp_path: Path) -> None:
    env_file = tmp_path / "attempt" / "mlflow_env.json"
    env_file.parent.mkdir()
    hook = write_hook(tmp_path / "attempt" / "mlflow_hook", env_file, wait_s=120)
    users = tmp_path / "users-site"
    users.mkdir()
    (users / "sitecustomize.py").write_text("import os\nos.environ['USERS_SITE'] = 'ran'\n")

    # A look (find_spec, importlib.metadata) costs nothing although the run does not exist yet.
    started = time.monotonic()
    look = _python("import importlib.util, importlib.metadata, os, sys\n"
                   "assert importlib.util.find_spec('mlflow') is not None\n"
                   "importlib.metadata.version('mlflow')\n"
                   "print(os.environ.get('USERS_SITE'), os.environ.get('MLFLOW_TRACKING_URI'), 'mlflow' in sys.modules)",
                   hook, str(users))
    assert look.returncode == 0 and look.stderr == "", look.stderr  # (a broken hook says so on stderr)
    assert look.stdout.split() == ["ran", "None", "False"]
    assert time.monotonic() - started < 60  # far below the hook's 120 s wait

    # A real import waits for the run's variables, then sees them.
    waiter = subprocess.Popen([sys.executable, "-c", "import os, mlflow; print(os.environ['MLFLOW_RUN_ID'])"],
                              env={**{k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")},
                                   "PYTHONPATH": str(hook)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1.0)
        assert waiter.poll() is None, waiter.communicate()
        write_env(env_file, {"MLFLOW_RUN_ID": "abc123", "MLFLOW_EXPERIMENT_ID": "7"})
        out, err = waiter.communicate(timeout=180)
    finally:
        if waiter.poll() is None:
            waiter.kill()
    assert waiter.returncode == 0, err
    assert out.strip() == "abc123"

    # Once the file exists, any new process has the variables at start (no import needed).
    now = _python("import os; print(os.environ['MLFLOW_RUN_ID'], os.environ['MLFLOW_EXPERIMENT_ID'])", hook)
    assert now.stdout.split() == ["abc123", "7"], now.stderr

    # No run at all (`{}`): an import goes on at once without one.
    write_env(env_file, {})
    done = _python("import os, mlflow; print(os.environ.get('MLFLOW_RUN_ID'))", hook)
    assert done.returncode == 0 and done.stdout.strip() == "None", done.stderr


def test_a_node_starts_before_its_mlflow_run_exists_and_logs_into_it(tmp_path: Path, air_home: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """MLflow is frozen: the test holds the embedded store's creation lock (store.prepare_store takes it
    before anyone opens the store), so the attempt's MLflow run cannot be made. The node's command still
    runs and writes its line (nodes do not wait for MLflow); once the lock is let go, the run is made, the
    node's held `import mlflow` goes on into it, and the run ends SUCCESS with its metric."""
    monkeypatch.setenv("AIR_TRACKING_EARLY_START", "on")
    marks = tmp_path / "marks"
    marks.mkdir()
    path = write_workload(tmp_path, "early", f"""
        experiment_name: early-exp
        compute: {{num_accelerators: 1, accelerator_type: CPU_1xCPU}}
        parameters: {{lr: 0.5}}
        command: |
          echo "${{MLFLOW_EXPERIMENT_ID:-unset}}" > {marks}/started
          python - <<'PY'
          import mlflow
          for step in range(3):
              mlflow.log_metric("loss", 1.0 / (step + 1), step=step)
          print("run", mlflow.active_run().info.run_id)
          PY
    """)
    lock_path = AirHome().mlflow_db_lock
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # MLflow frozen: no process can create (or open) the store
        try:
            run_id = submit(path)
            # (the shell makes the file before it writes the line: wait for the line itself)
            wait_for(lambda: (marks / "started").exists() and (marks / "started").read_text().strip(),
                     "the node's first line while MLflow is frozen", timeout=300)
            paths = RunPaths(run_id)
            # The node ran while its MLflow run could not exist: nothing named it, nothing was written.
            assert (marks / "started").read_text().strip() == "unset"
            assert not paths.mlflow_env(0).exists()
            assert not (air_home / "mlflow.db").exists()
            assert not RunStore().get_run(run_id).is_terminal
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    run = wait_terminal(run_id, timeout=300)
    assert run.status.value == "SUCCESS", run.termination_reason
    tracking_done(run.id)  # the last attempt's MLflow run id is recorded after the run's end
    mlflow_run_id = json.loads(paths.mlflow_env(0).read_text())["MLFLOW_RUN_ID"]
    assert RunStore().list_attempts(run.id)[0].mlflow_run_id == mlflow_run_id == RunStore().get_run(run.id).mlflow_run_id
    assert f"run {mlflow_run_id}" in paths.node_log(0, 0).read_text()
    client = _client(air_home)
    record = mlflow_run_ended(client, mlflow_run_id, air_run_id=run.id)  # (ended right after its SUCCESS)
    assert record.info.status == "FINISHED" and record.data.params["lr"] == "0.5"
    assert [m.value for m in client.get_metric_history(mlflow_run_id, "loss")] == [1.0, 0.5, 1 / 3]
    assert {a.path for a in client.list_artifacts(mlflow_run_id, "logs/attempt_0")} == {"logs/attempt_0/node_0.log"}


def test_32_nodes_one_sampler_no_stall_metrics_of_every_node(tmp_path: Path, air_home: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    nodes = 32
    monkeypatch.setenv("AIR_CPU_SLOTS", str(nodes))
    marks = tmp_path / "marks"
    marks.mkdir()
    # Node 0 uses MLflow (so the run exists while the nodes run); every node waits for it, then ends.
    path = write_workload(tmp_path, "wide", f"""
        experiment_name: wide-exp
        compute: {{num_accelerators: {nodes}, accelerator_type: CPU_1xCPU}}
        command: |
          if [ "$NODE_RANK" = 0 ]; then
            python -c "import mlflow; mlflow.log_metric('up', 1.0)"
            touch {marks}/ready
          fi
          for _ in $(seq 1 3000); do [ -e {marks}/ready ] && break; sleep 0.2; done
          sleep 3
          echo "node $NODE_RANK done"
          date +%s.%N > {marks}/exit_$NODE_RANK
    """)
    run = wait_terminal(submit(path), timeout=600)
    assert run.status.value == "SUCCESS", run.termination_reason
    last_exit = max(float((marks / f"exit_{n}").read_text()) for n in range(nodes))
    assert run.ended_at is not None
    assert run.ended_at - last_exit < 2.0, f"the attempt ended {run.ended_at - last_exit:.2f} s after its last node"
    tracking_done(run.id)  # the last attempt's MLflow run id is recorded after the run's end
    run = RunStore().get_run(run.id)
    client = _client(air_home)
    record = mlflow_run_ended(client, str(run.mlflow_run_id), air_run_id=run.id)
    metrics = record.data.metrics
    for n in range(nodes):
        assert f"system/node_{n}/cpu_utilization_percentage" in metrics, n
        assert f"system/node_{n}/system_memory_usage_megabytes" in metrics, n
        assert record.data.tags[f"air.host.node_{n}"] == os.uname().nodename
    artifacts = {a.path for a in client.list_artifacts(str(run.mlflow_run_id), "logs/attempt_0")}
    assert artifacts == {f"logs/attempt_0/node_{n}.log" for n in range(nodes)}
    paths = RunPaths(run.id)
    for n in range(nodes):
        assert "[air] tracking" not in paths.node_log(0, n).read_text()
    warnings = [line for line in paths.supervisor_log.read_text().splitlines() if "tracking:" in line]
    assert len(warnings) == len(set(line.split(" ", 1)[1] for line in warnings)), warnings  # each at most once
