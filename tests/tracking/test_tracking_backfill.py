"""An attempt that ran while its MLflow run could not be made gets it afterwards (issue 24, back-fill):
real detached back-fill process, real MLflow (air's embedded store)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from air.tracking.backfill import backfill_later, missing
from proc_helpers import wait_for


@pytest.mark.timeout(300)
def test_an_attempt_without_its_mlflow_run_gets_it_made_with_status_logs_and_end_time(air_home: Path,
                                                                                     tmp_path: Path) -> None:
    attempt_dir = tmp_path / "attempt_0"
    attempt_dir.mkdir()
    env_file, ref, node_log = attempt_dir / "mlflow_env.json", attempt_dir / "tracking.json", attempt_dir / "node_0.log"
    env_file.write_text("{}")  # what the supervisor writes when the run could not be made
    node_log.write_text("hello from node 0\n")
    params = tmp_path / "hyperparameters.yaml"
    params.write_text("lr: 0.1\n")
    assert missing(env_file, ref, None)
    assert not missing(env_file, ref, "some-id")
    log = tmp_path / "supervisor.log"
    job = {"experiment": "filled", "run_name": "late", "params_file": str(params),
           "tags": {"air.run_id": "run-x"},
           "attempts": [{"index": 0, "status": "SUCCESS", "started_at": 1000.0, "ended_at": 2000.0,
                         "ref": str(ref), "node_logs": {"0": str(node_log)}}]}
    assert backfill_later(job, log)
    wait_for(lambda: ref.exists() or "could not" in (log.read_text() if log.exists() else ""),
             "the back-fill's tracking note", timeout=240)
    assert ref.exists(), log.read_text()
    assert not missing(env_file, ref, None)  # made once, not again

    from mlflow import MlflowClient

    note = json.loads(ref.read_text())
    client = MlflowClient(note["tracking_uri"])
    run = client.get_run(note["run_id"])
    assert run.info.status == "FINISHED"
    assert run.info.end_time == 2_000_000
    assert run.data.params == {"lr": "0.1"}
    assert run.data.tags["air.backfilled"] == "true" and run.data.tags["air.attempt"] == "0"
    artifacts = [a.path for a in client.list_artifacts(note["run_id"], "logs/attempt_0")]
    assert artifacts == ["logs/attempt_0/node_0.log"]
    assert "made afterwards (FINISHED)" in log.read_text()


SPOOLED = """\
import os, mlflow
for step in range(5):
    mlflow.log_metric("early", float(step), step=step)
mlflow.log_param("seen", "yes")
print("uri", os.environ["MLFLOW_TRACKING_URI"], flush=True)
"""


@pytest.mark.timeout(300)
def test_a_node_that_gave_up_waiting_logs_locally_and_nothing_reaches_a_stray_run(air_home: Path,
                                                                                 tmp_path: Path) -> None:
    """The hook's give-up path: a node's `import mlflow` waited for the run (a short wait here), then its
    metrics go to a local store under the hook's folder, never to an http server with no run id (MLflow
    would make a stray run there); the supervisor later copies them into the attempt's run."""
    import os
    import subprocess

    from mlflow import MlflowClient

    from air.tracking.attempt import start_attempt_run
    from air.tracking.backfill import copy_spool
    from air.tracking.node_hook import spool_of, write_hook

    attempt_dir = tmp_path / "attempt_0"
    env_file, hook = attempt_dir / "mlflow_env.json", attempt_dir / "mlflow_hook"
    write_hook(hook, env_file, wait_s=0.5)
    script = tmp_path / "node.py"
    script.write_text(SPOOLED)
    # Port 9 (discard) on loopback: nothing answers; a call that reached it would fail, not spool.
    env = {**os.environ, "PYTHONPATH": str(hook), "MLFLOW_TRACKING_URI": "http://127.0.0.1:9",
           "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_ENABLE_ASYNC_LOGGING": "false"}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert f"uri file://{spool_of(hook)}/" in done.stdout
    assert "logs locally" in done.stderr
    # A process started after the supervisor gave up (`{}`) spools at once, without waiting.
    env_file.write_text("{}")
    again = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240)
    assert again.returncode == 0 and f"uri file://{spool_of(hook)}/" in again.stdout, again.stderr

    handle = start_attempt_run("spooled", None, tags={"air.attempt": "0"}, params={})
    assert handle is not None
    lines: list[str] = []
    assert copy_spool(spool_of(hook), handle, lines.append) == 10
    assert copy_spool(spool_of(hook), handle, lines.append) == 0  # copied once
    client = MlflowClient(handle.tracking_uri)
    history = sorted((m.step, m.value) for m in client.get_metric_history(handle.run_id, "early"))
    assert history == sorted([(s, float(s)) for s in range(5)] * 2)
    assert client.get_run(handle.run_id).data.params == {"seen": "yes"}


@pytest.mark.timeout(300)
def test_a_spool_copies_no_file_from_outside_its_store(air_home: Path, tmp_path: Path) -> None:
    """The spool is written by the node: a spooled run whose artifact location points out of its store, or
    whose artifacts are links to other files, must not make the copier upload those files."""
    import os

    from mlflow import MlflowClient

    from air.tracking.attempt import start_attempt_run
    from air.tracking.backfill import copy_spool

    secret_dir = tmp_path / "outside"
    secret_dir.mkdir()
    (secret_dir / "secret.txt").write_text("SERVER-SECRET")
    spool = tmp_path / "spool"
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    try:
        local = MlflowClient((spool / "1234").as_uri())
        away = local.create_experiment("away", artifact_location=secret_dir.as_uri())
        run = local.create_run(away)
        local.log_metric(run.info.run_id, "m", 1.0)
        Path(run.info.artifact_uri.removeprefix("file://")).mkdir(parents=True, exist_ok=True)
        (Path(run.info.artifact_uri.removeprefix("file://")) / "secret.txt").write_text("SERVER-SECRET")
        linked = local.create_run(local.create_experiment("linked"))
        folder = Path(linked.info.artifact_uri.removeprefix("file://"))
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "mine.txt").write_text("the node's own")
        (folder / "link.txt").symlink_to(secret_dir / "secret.txt")
        (folder / "dir").symlink_to(secret_dir, target_is_directory=True)
    finally:
        os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)

    handle = start_attempt_run("spool-walls", None, tags={"air.attempt": "0"}, params={})
    assert handle is not None
    assert copy_spool(spool, handle, [].append) == 1
    client = MlflowClient(handle.tracking_uri)
    assert [a.path for a in client.list_artifacts(handle.run_id)] == ["mine.txt"]
    root = Path(client.get_run(handle.run_id).info.artifact_uri.removeprefix("file://"))
    assert all(b"SERVER-SECRET" not in p.read_bytes() for p in root.rglob("*") if p.is_file())
