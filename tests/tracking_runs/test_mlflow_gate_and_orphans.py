"""Part F of issue 24: tracking fixes at the edges of a run (a look at MLflow is not use; a killed
supervisor's MLflow run is ended; `@ray_launch` without an active run)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from proc_helpers import alive, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workload_runs"))
from runs_helpers import air, submit, wait_status, write_workload


def _client(air_home: Path):
    """A client of the embedded store, created under air's lock (a recorder may be creating it too)."""
    import mlflow

    from air.tracking import prepare_store

    uri = f"sqlite:///{air_home}/mlflow.db"
    prepare_store(uri)
    return mlflow.MlflowClient(uri)


def _run_call(tmp_path: Path, body: str) -> tuple[list[dict], str]:
    """A 2-rank call from a fresh caller that has not imported mlflow (so the run is made lazily)."""
    script = tmp_path / "call.py"
    script.write_text(textwrap.dedent("""
        import json, sys
        from air import distributed

        @distributed(num_accelerators=2, accelerator_type="CPU")
        def probe():
            import importlib.metadata, importlib.util, os, sys, time
        """) + textwrap.indent(textwrap.dedent(body), "    ") + textwrap.dedent("""
        assert "mlflow" not in sys.modules  # or the caller would make the run before the ranks start
        print("RESULT " + json.dumps(probe.distributed()))
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return list(json.loads(line[len("RESULT "):])), out.stderr


def _attempt_dir(air_home: Path) -> Path:
    [attempt] = list((air_home / "runs").glob("*/attempt_0"))
    return attempt


def test_looking_for_mlflow_makes_no_run_and_costs_nothing(tmp_path: Path, air_home: Path) -> None:
    """transformers/accelerate only look (find_spec, importlib.metadata): no MLflow run is made for it
    while the ranks run, and the look does not wait for one (it waited for the run's creation before)."""
    results, _ = _run_call(tmp_path, """
        start = time.monotonic()
        found = importlib.util.find_spec("mlflow") is not None
        version = importlib.metadata.version("mlflow")
        return {"found": found, "version": version, "look_s": time.monotonic() - start,
                "imported": "mlflow" in sys.modules, "run_id": os.environ.get("MLFLOW_RUN_ID")}
    """)
    assert [r["found"] for r in results] == [True, True] and all(r["version"] for r in results)
    assert [r["imported"] for r in results] == [False, False]
    assert [r["run_id"] for r in results] == [None, None]
    # Waiting for the run meant seconds (an import of mlflow and a store's set-up): a look is a file lookup.
    assert max(r["look_s"] for r in results) < 1.0, results
    attempt = _attempt_dir(air_home)
    assert not (attempt / "mlflow_request").exists(), "a look at MLflow asked for the call's MLflow run"
    assert (attempt / "mlflow_record.json").exists(), "the call should be recorded after it ended, unused"
    # The detached recorder finishes (and leaves nothing running) before the test ends.
    wait_for(lambda: (attempt / "mlflow_env.json").exists(), "the recorder to record the call", timeout=180)


def test_importing_mlflow_after_a_look_still_gets_the_calls_run(tmp_path: Path, air_home: Path) -> None:
    client = _client(air_home)  # the store's schema first: made by the caller, it can outlast the gate's wait
    results, stderr = _run_call(tmp_path, """
        assert importlib.util.find_spec("mlflow") is not None and "mlflow" not in sys.modules
        import mlflow
        mlflow.log_metric("looked_then_logged", float(os.environ["RANK"]), step=int(os.environ["RANK"]))
        # MLflow's start_run takes MLFLOW_RUN_ID out of the environment: ask it which run it logged to.
        return {"run_id": mlflow.active_run().info.run_id, "loader": type(mlflow.__loader__).__name__}
    """)
    run_ids = {r["run_id"] for r in results}
    assert len(run_ids) == 1 and None not in run_ids, (results, stderr[-3000:])
    assert {r["loader"] for r in results} == {"SourceFileLoader"}  # mlflow looks as if imported without air
    assert (_attempt_dir(air_home) / "mlflow_request").exists()
    [run_id] = run_ids
    history = client.get_metric_history(run_id, "looked_then_logged")
    assert sorted((m.step, m.value) for m in history) == [(0, 0.0), (1, 1.0)]
    assert client.get_run(run_id).info.status == "FINISHED"


def test_killed_supervisors_mlflow_run_is_ended_by_the_next_command(tmp_path: Path, air_home: Path) -> None:
    """kill -9 of the supervisor: `air list runs` reconciles the run (INTERNAL_ERROR) and its attempt's MLflow
    run is ended FAILED with an end time, not left RUNNING forever. (The node logs with MlflowClient: the
    fluent API would end the run itself FINISHED when its process exits.)"""
    import os
    import signal

    from air.store.run_store import RunStore

    logged = tmp_path / "logged"
    path = write_workload(tmp_path, "orphan", f"""
        experiment_name: orphan-tracked
        compute: {{num_accelerators: 1, accelerator_type: CPU_1xCPU}}
        max_retries: 0
        command: |
          python -c "import os, mlflow; mlflow.MlflowClient().log_metric(os.environ['MLFLOW_RUN_ID'], 'step', 1.0)"
          touch {logged}
          sleep 1000
    """)
    run_id = submit(path)
    wait_for(logged.exists, "the node to log to its MLflow run", timeout=240)
    run = wait_status(run_id, "RUNNING")
    [attempt] = RunStore().list_attempts(run_id)
    assert attempt.mlflow_run_id, "the attempt's MLflow run is not linked in the run store"
    client = _client(air_home)
    assert client.get_run(attempt.mlflow_run_id).info.status == "RUNNING"
    os.kill(run.supervisor_pid, signal.SIGKILL)
    wait_for(lambda: alive([run.supervisor_pid]) == [], "the supervisor to die")

    listed = air("list", "runs", "--all-status", "--json")
    assert listed.returncode == 0, listed.stderr
    assert RunStore().get_run(run_id).status.value == "INTERNAL_ERROR"

    def ended():
        info = client.get_run(attempt.mlflow_run_id).info
        return info if info.status != "RUNNING" else None

    info = wait_for(ended, "the attempt's MLflow run to be ended", timeout=120, interval=0.5)
    assert info.status in ("FAILED", "KILLED") and info.end_time, info
    assert client.get_metric_history(attempt.mlflow_run_id, "step")[0].value == 1.0
    from air.store.paths import RunPaths

    assert "ended FAILED" in RunPaths(run_id).supervisor_log.read_text()
