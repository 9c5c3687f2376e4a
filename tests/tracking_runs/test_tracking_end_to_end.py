"""MLflow records of real workload runs and real @distributed calls, in the embedded SQLite store."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from air import distributed
from air.settings import AIR_TRACKING_GIVE_UP_S
from air.store.run_store import RunStore
from proc_helpers import mlflow_run_ended, tracking_done, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workload_runs"))
from runs_helpers import submit, wait_terminal, write_workload


def _client(air_home: Path):
    """A client of the embedded store, created under air's lock (a recorder may be creating it too)."""
    import mlflow

    from air.tracking import prepare_store

    uri = f"sqlite:///{air_home}/mlflow.db"
    prepare_store(uri)
    return mlflow.MlflowClient(uri)


def test_workload_run_lands_in_mlflow(tmp_path: Path, air_home: Path) -> None:
    marker = tmp_path / "retry-once"
    path = write_workload(tmp_path, "tracked", f"""
        experiment_name: tracked-exp
        mlflow_run_name: lr-sweep
        compute: {{num_accelerators: 2, accelerator_type: CPU_1xCPU}}
        max_retries: 1
        parameters: {{lr: 0.001, model: {{name: tiny, layers: 2}}}}
        command: |
          python - <<'PY'
          import os, mlflow
          if os.environ["NODE_RANK"] == "0":
              for step in range(3):
                  mlflow.log_metric("loss", 1.0 / (step + 1), step=step)
          PY
          echo "node $NODE_RANK done"
          if [ ! -e {marker} ]; then
            [ "$NODE_RANK" = 1 ] && {{ touch {marker}; echo "RuntimeError: first attempt" >&2; exit 1; }}
            sleep 5
          fi
    """)
    run = wait_terminal(submit(path), timeout=180)
    assert run.status.value == "SUCCESS" and run.attempt_count == 2
    tracking_done(run.id)  # (the last attempt's MLflow id is recorded just after the run's end)
    attempts = RunStore().list_attempts(run.id)
    client = _client(air_home)
    experiment = client.get_experiment_by_name("tracked-exp")
    assert experiment is not None and experiment.tags.get("air-show-logs") == "true"
    mlflow_runs = {a.index: mlflow_run_ended(client, str(a.mlflow_run_id)) for a in attempts}
    assert len({r.info.run_id for r in mlflow_runs.values()}) == 2  # one MLflow run per attempt
    first, second = mlflow_runs[0], mlflow_runs[1]
    assert first.info.status == "FAILED" and second.info.status == "FINISHED"
    assert second.info.run_name == "lr-sweep"
    tags = second.data.tags
    assert tags["air.run_id"] == run.id and tags["air.attempt"] == "1"
    assert tags["air.accelerator_type"] == "CPU_1xCPU" and tags["air.num_nodes"] == "2"
    assert second.data.params["lr"] == "0.001" and second.data.params["model.name"] == "tiny"
    assert [m.value for m in client.get_metric_history(second.info.run_id, "loss")] == [1.0, 0.5, pytest.approx(1 / 3)]
    artifacts = {a.path for a in client.list_artifacts(second.info.run_id, "logs/attempt_1")}
    assert artifacts == {"logs/attempt_1/node_0.log", "logs/attempt_1/node_1.log"}
    local = client.download_artifacts(second.info.run_id, "logs/attempt_1/node_1.log", str(tmp_path))
    assert "node 1 done" in Path(local).read_text()
    system = [k for k in second.data.metrics if k.startswith("system/node_")]
    assert system, "no per-node system metrics were logged"


def test_four_ranks_logging_200_metrics_each_all_land(air_home: Path) -> None:
    @distributed(num_accelerators=4, accelerator_type="CPU")
    def log_many() -> str:
        import os

        import mlflow

        run_id = os.environ["MLFLOW_RUN_ID"]
        rank = int(os.environ["RANK"])
        for step in range(200):
            mlflow.log_metric(f"rank{rank}", step, step=step)
        return run_id

    run_ids = log_many.distributed()
    assert len(set(run_ids)) == 1
    client = _client(air_home)
    for rank in range(4):
        assert len(client.get_metric_history(run_ids[0], f"rank{rank}")) == 200
    record = client.get_run(run_ids[0])
    assert record.info.status == "FINISHED"
    assert {a.path for a in client.list_artifacts(run_ids[0], "logs")} == {f"logs/rank_{r}.log" for r in range(4)}


def test_call_nested_under_the_callers_active_run(air_home: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import mlflow
    from mlflow.tracking import fluent

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{air_home}/mlflow.db")
    monkeypatch.setattr(fluent, "_active_experiment_id", fluent._active_experiment_id)  # undone after the test
    # The user's own experiment (MLflow would put its artifacts in ./mlruns; keep them in the test's folder).
    _client(air_home).create_experiment("notebook", artifact_location=(tmp_path / "artifacts").as_uri())
    mlflow.set_experiment("notebook")

    @distributed(num_accelerators=2, accelerator_type="CPU")
    def report() -> str:
        import os

        return os.environ["MLFLOW_RUN_ID"]

    with mlflow.start_run() as parent:
        ids = report.distributed()
        assert mlflow.active_run().info.run_id == parent.info.run_id  # the caller's run is untouched
    child = _client(air_home).get_run(ids[0])
    assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert child.info.experiment_id == parent.info.experiment_id and child.info.status == "FINISHED"


def test_failed_call_is_marked_failed(air_home: Path) -> None:
    @distributed(num_accelerators=2, accelerator_type="CPU")
    def boom() -> str:
        import os

        if os.environ["RANK"] == "1":
            raise ValueError("boom")
        return "survived"

    with pytest.raises(ValueError, match="boom"):
        boom.distributed()
    client = _client(air_home)

    def call_runs() -> list:
        found = [r for r in client.search_runs([e.experiment_id for e in client.search_experiments()])
                 if "air.call" in r.data.tags and r.info.status != "RUNNING"]
        if not found or len(client.list_artifacts(found[0].info.run_id, "logs")) != 2:
            return []
        return found

    runs = wait_for(call_runs, "the call's MLflow run", timeout=60)  # recorded after the call, if no rank used MLflow
    assert [r.info.status for r in runs] == ["FAILED"]
    assert {a.path for a in client.list_artifacts(runs[0].info.run_id, "logs")} == {"logs/rank_0.log", "logs/rank_1.log"}


def test_unreachable_tracking_server_is_a_warning_not_a_failure(tmp_path: Path, air_home: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed_port = sock.getsockname()[1]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{closed_port}")
    monkeypatch.setenv(AIR_TRACKING_GIVE_UP_S, "3")  # its supervisor gives up on the server soon, and exits
    path = write_workload(tmp_path, "offline", """
        experiment_name: offline
        compute: {num_accelerators: 1, accelerator_type: CPU_1xCPU}
        max_retries: 0
        command: echo trained
    """)
    run = wait_terminal(submit(path), timeout=120)
    assert run.status.value == "SUCCESS"
    from air.store.paths import RunPaths

    # The run's end state comes first; its supervisor's MLflow attempt (and its warning) may come after.
    supervisor_log = RunPaths(run.id).supervisor_log
    wait_for(lambda: "tracking" in supervisor_log.read_text(), "air's tracking warning in supervisor.log",
             timeout=300)  # said in supervisor.log
    log = RunPaths(run.id).node_log(0, 0).read_text()
    assert "trained" in log and "tracking" not in log  # air's tracking warnings stay out of the node's log
    tracking_done(run.id, timeout=120)  # nothing of the run outlives the test


def test_call_whose_ranks_never_use_mlflow_is_recorded_after_it_returns(tmp_path: Path, air_home: Path) -> None:
    import subprocess
    import textwrap

    script = tmp_path / "plain.py"
    script.write_text(textwrap.dedent("""
        import sys
        from air import distributed

        @distributed(num_accelerators=2, accelerator_type="CPU")
        def plain():
            return 1

        assert plain.distributed() == [1, 1]
        print("mlflow imported by the caller:", "mlflow" in sys.modules)
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "mlflow imported by the caller: False" in out.stdout
    client = _client(air_home)

    def recorded() -> list:
        try:
            runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
        except Exception:  # the recorder may be creating the store right now
            return []
        return [r for r in runs if r.data.tags.get("air.call") and r.info.status == "FINISHED"]

    runs = wait_for(recorded, "the recorder to log the call", timeout=90)
    assert len(runs) == 1 and runs[0].info.run_name == "plain"


def test_recorders_of_one_air_home_take_turns(tmp_path: Path, air_home: Path) -> None:
    """A detached recorder waits for the one before it (each imports mlflow: ~2 s of CPU), so a loop of
    quick calls does not start that many at once. Here the test holds the lock the recorders share."""
    import fcntl
    import subprocess
    import textwrap

    from air.home import AirHome

    script = tmp_path / "quick.py"
    script.write_text(textwrap.dedent("""
        from air import distributed
        assert distributed(num_accelerators=1, accelerator_type="CPU")(lambda: 1).distributed() == [1]
    """))
    air_home.mkdir(parents=True, exist_ok=True)
    with open(AirHome(air_home).mlflow_recorder_lock, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr

        def waiting_recorder() -> list[str]:
            import psutil

            recorders = {str(p.pid) for p in psutil.process_iter(["cmdline"])
                         if str(air_home) in " ".join(p.info["cmdline"] or []) and "air.distributed.tracked"
                         in (p.info["cmdline"] or [])}
            return [line for line in Path("/proc/locks").read_text().splitlines()
                    if "-> FLOCK" in line and line.split()[5] in recorders]

        wait_for(waiting_recorder, "the recorder to wait for the lock", timeout=30)
        assert not list((air_home / "runs").glob("*/attempt_0/mlflow_env.json"))  # nothing recorded meanwhile
        fcntl.flock(held, fcntl.LOCK_UN)
    wait_for(lambda: list((air_home / "runs").glob("*/attempt_0/mlflow_env.json")), "the recorder, once let through",
             timeout=90)
