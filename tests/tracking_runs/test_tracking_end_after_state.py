"""Tracking off the critical path (issue 24): with tracking on (and early start, the default) a node
starts before its MLflow run exists, the run's SUCCESS is written before its MLflow run is ended, and
every reader still sees the attempt's MLflow run: ended FINISHED with the node's metric and log, and a
retry's RETRY naming both attempts' runs. Real `air run`/`air subscribe` processes, the real embedded store."""

from __future__ import annotations

import fcntl
import json
import sys
from pathlib import Path

import pytest

from air.home import AirHome
from air.store.paths import RunPaths
from air.store.run_store import RunStore
from proc_helpers import mlflow_run_ended, tracking_done

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workload_runs"))
from runs_helpers import air, submit, wait_terminal, write_workload


def _client(air_home: Path):  # type: ignore[no-untyped-def]
    import mlflow

    from air.tracking import prepare_store

    uri = f"sqlite:///{air_home}/mlflow.db"
    prepare_store(uri)
    return mlflow.MlflowClient(uri)


def test_success_is_written_before_the_mlflow_end_and_the_run_still_ends_finished(
        tmp_path: Path, air_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIR_TRACKING_EARLY_START", raising=False)  # the default
    monkeypatch.delenv("AIR_TRACKING", raising=False)
    # No store prepared first: the run is the first of a fresh AIR_HOME, whose node logs at once (a fresh
    # store's schema migration once raced between air and the node: "duplicate column name: step").
    marks = tmp_path / "marks"
    marks.mkdir()
    path = write_workload(tmp_path, "p4", f"""
        experiment_name: p4-exp
        compute: {{num_accelerators: 1, accelerator_type: CPU_1xCPU}}
        command: |
          echo "${{MLFLOW_EXPERIMENT_ID:-unset}}" > {marks}/started
          python - <<'PY'
          import mlflow
          mlflow.log_metric("loss", 0.25)
          print("logged into", mlflow.active_run().info.run_id)
          PY
    """)
    run = wait_terminal(submit(path), timeout=300)
    assert run.status.value == "SUCCESS", run.termination_reason
    assert run.ended_at is not None
    tracking_done(run.id)  # the last attempt's MLflow run id is recorded after the run's end, by its supervisor
    paths = RunPaths(run.id)
    # The node was started without waiting for its MLflow run (early start): its environment named none;
    # its Python learned it from the hook.
    assert (marks / "started").read_text().strip() == "unset"
    # The attempt's end was recorded with its MLflow run id (what `air get run` and RETRY read).
    [attempt] = RunStore().list_attempts(run.id)
    mlflow_run_id = json.loads(paths.mlflow_env(0).read_text())["MLFLOW_RUN_ID"]
    assert attempt.ended_at is not None and attempt.mlflow_run_id == mlflow_run_id == RunStore().get_run(run.id).mlflow_run_id
    client = _client(air_home)
    record = mlflow_run_ended(client, mlflow_run_id, air_run_id=run.id)
    # SUCCESS first, the MLflow end (log uploads, then the status) after it, by the same supervisor. (The
    # run's end_time is the node's: MLflow's fluent API ends the run as the node's Python exits.) The
    # upload's copy lands in the embedded artifact root after the run's end state was written.
    uploaded = Path(record.info.artifact_uri.removeprefix("file://")) / "logs" / "attempt_0" / "node_0.log"
    assert uploaded.stat().st_ctime >= run.ended_at, (uploaded.stat().st_ctime, run.ended_at)
    assert record.info.status == "FINISHED"
    assert record.data.metrics["loss"] == 0.25
    assert {a.path for a in client.list_artifacts(mlflow_run_id, "logs/attempt_0")} == {"logs/attempt_0/node_0.log"}
    local = client.download_artifacts(mlflow_run_id, "logs/attempt_0/node_0.log", str(tmp_path))
    assert f"logged into {mlflow_run_id}" in Path(local).read_text()


def test_a_failing_first_attempts_retry_names_its_mlflow_run(tmp_path: Path, air_home: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIR_TRACKING_EARLY_START", raising=False)  # the default: nodes start at once
    monkeypatch.delenv("AIR_TRACKING", raising=False)
    marker = tmp_path / "first-attempt-done"  # (a fresh store: no schema prepared first)
    path = write_workload(tmp_path, "p4-retry", f"""
        experiment_name: p4-retry
        compute: {{num_accelerators: 1, accelerator_type: CPU_1xCPU}}
        max_retries: 1
        command: |
          if [ ! -e {marker} ]; then touch {marker}; echo "first attempt fails at once"; exit 3; fi
          echo "second attempt fine"
    """)
    run_id = submit(path)
    result = air("subscribe", run_id, "--no-default-metrics", timeout=300)
    assert result.returncode == 0, result.stderr
    events = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    retries = [e for e in events if e["type"] == "RETRY"]
    assert len(retries) == 1, events
    tracking_done(run_id)
    attempts = {a.index: a for a in RunStore().list_attempts(run_id)}
    assert retries[0]["previous_mlflow_run_id"] == attempts[0].mlflow_run_id is not None
    assert retries[0]["new_mlflow_run_id"] == attempts[1].mlflow_run_id is not None
    assert attempts[0].mlflow_run_id != attempts[1].mlflow_run_id
    client = _client(air_home)
    assert mlflow_run_ended(client, str(attempts[0].mlflow_run_id)).info.status == "FAILED"
    assert mlflow_run_ended(client, str(attempts[1].mlflow_run_id)).info.status == "FINISHED"


def test_three_runs_on_a_fresh_store_whose_node_logs_at_once_all_succeed_with_their_metric(
        tmp_path: Path, air_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh AIR_HOME (no MLflow store yet), early start on: the node's `mlflow.log_metric` right away
    never meets MLflow's schema migration half done (it once failed: "duplicate column name: step")."""
    monkeypatch.delenv("AIR_TRACKING_EARLY_START", raising=False)  # the default: nodes start at once
    monkeypatch.delenv("AIR_TRACKING", raising=False)
    assert not (air_home / "mlflow.db").exists()
    path = write_workload(tmp_path, "fresh", """
        experiment_name: p4-fresh
        compute: {num_accelerators: 1, accelerator_type: CPU_1xCPU}
        command: python -c "import mlflow; mlflow.log_metric('first', 1.5); print('logged')"
    """)
    runs = []
    for _ in range(3):
        run = wait_terminal(submit(path), timeout=300)
        log = RunPaths(run.id).node_log(0, 0).read_text()
        assert run.status.value == "SUCCESS", (run.termination_reason, log)
        assert "logged" in log and "OperationalError" not in log, log
        runs.append(run.id)
    client = _client(air_home)
    for run_id in runs:
        tracking_done(run_id)
        mlflow_run_id = RunStore().get_run(run_id).mlflow_run_id
        assert mlflow_run_id, run_id
        record = mlflow_run_ended(client, mlflow_run_id, air_run_id=run_id)
        assert record.info.status == "FINISHED" and record.data.metrics["first"] == 1.5
        supervisor_log = RunPaths(run_id).supervisor_log.read_text()
        assert "OperationalError" not in supervisor_log and "tracking: off" not in supervisor_log, supervisor_log


def test_the_last_attempt_ends_the_run_while_mlflow_is_frozen_and_its_run_is_recorded_after(
        tmp_path: Path, air_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The test holds the embedded store's creation lock (store.prepare_store takes it before anyone opens
    the store): the attempt's MLflow run cannot be made. The run still ends SUCCESS (its end state does not
    wait for MLflow); `air get run` says its MLflow run is being recorded; once the lock is let go the same
    supervisor makes the MLflow run, records its id on the attempt and the run, ends it FINISHED, and exits."""
    monkeypatch.delenv("AIR_TRACKING_EARLY_START", raising=False)
    monkeypatch.delenv("AIR_TRACKING", raising=False)
    path = write_workload(tmp_path, "frozen", """
        experiment_name: p4-frozen
        compute: {num_accelerators: 1, accelerator_type: CPU_1xCPU}
        command: echo "no MLflow here"
    """)
    with open(AirHome().mlflow_db_lock, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # MLflow frozen
        try:
            run = wait_terminal(submit(path), timeout=300)
            assert run.status.value == "SUCCESS", run.termination_reason
            assert run.mlflow_run_id is None and not (air_home / "mlflow.db").exists()
            [attempt] = RunStore().list_attempts(run.id)
            assert attempt.ended_at is not None and attempt.mlflow_run_id is None
            shown = json.loads(air("get", "run", run.id, "--json").stdout)["data"]
            assert shown["status"] == "SUCCESS" and shown["mlflow_recording"] is True, shown
            assert "recording…" in air("get", "run", run.id).stdout
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    tracking_done(run.id)
    ended = RunStore().get_run(run.id)
    [attempt] = RunStore().list_attempts(run.id)
    assert ended.mlflow_run_id and attempt.mlflow_run_id == ended.mlflow_run_id
    assert ended.ended_at == run.ended_at and ended.status.value == "SUCCESS"
    shown = json.loads(air("get", "run", run.id, "--json").stdout)["data"]
    assert shown["mlflow_recording"] is False and shown["mlflow_run_id"] == ended.mlflow_run_id
    assert "recording…" not in air("get", "run", run.id).stdout
    record = mlflow_run_ended(_client(air_home), ended.mlflow_run_id, air_run_id=run.id)
    assert record.info.status == "FINISHED"
