"""Every attempt has its MLflow run, whatever the tracking server's state when it ran (issue 24): a run that
ends while `air server` (and its MLflow) is away, whose supervisor gives up waiting and exits, is marked
"tracking pending"; the server, started again, makes the attempt's MLflow run once its MLflow answers (status,
node log, the metrics its node logged locally meanwhile), links it in the store and removes the marker; it is
made once. Real server, real supervisor and node, real MLflow behind the door.

AIR_TRACKING_GIVE_UP_S (a test knob) shortens the supervisor's waits (300 s + 240 s) and its node's (120 s)
to seconds, and
AIR_MLFLOW_HOLD keeps the server's MLflow "starting" while the run starts, so the order is certain however
loaded the machine is."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import urllib.parse
import urllib.request
from contextlib import suppress
from pathlib import Path
from typing import Any

import psutil
import pytest
from server_helpers import AIR, AirServer, alive, free_port, home_processes

from air.home import AirHome
from air.settings import AIR_MLFLOW_HOLD, AIR_TRACKING_GIVE_UP_S
from air.store.paths import RunPaths

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from proc_helpers import tracking_done, wait_for

NODE = """\
import mlflow
for step in range(5):
    mlflow.log_metric("spooled", float(step), step=step)
print("node done", flush=True)
"""


def _mlflow(srv: AirServer, endpoint: str, body: dict[str, Any] | None = None, /, **query: Any) -> Any:
    """GET (or with `body`, POST) through the server's door as its admin (the back-filled run is alice's)."""
    url = f"{srv.url}/mlflow{endpoint}?{urllib.parse.urlencode(query)}"
    headers = {"Authorization": f"Bearer {srv.tokens['root']}", "Content-Type": "application/json"}
    request = urllib.request.Request(url, headers=headers, data=None if body is None else json.dumps(body).encode(),
                                     method="GET" if body is None else "POST")
    with urllib.request.urlopen(request, timeout=60) as answer:  # the test's own server on loopback
        answered = answer.read()
    return json.loads(answered) if endpoint.startswith("/api/") else answered.decode()


def _mlflow_state(srv: AirServer) -> str | None:
    try:
        with urllib.request.urlopen(srv.url + "/api/v1/health", timeout=5) as answer:
            return str(json.loads(answer.read())["mlflow"]["state"])
    except (OSError, ValueError, KeyError):
        return None


def _start_with_mlflow_held(srv: AirServer) -> None:
    """`air server start` whose MLflow stays "starting" (AIR_MLFLOW_HOLD): its API answers, MLflow does not."""
    with open(srv.log, "ab") as log:
        srv.proc = subprocess.Popen([*AIR, "server", "start", "--port", str(srv.port), "--mlflow-port",
                                     str(srv.mlflow_port), *srv.start_args], env=srv.server_env(),
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    wait_for(lambda: _mlflow_state(srv) == "starting", f"the server's API with MLflow held (log: {srv.log})",
             timeout=240)


@pytest.mark.timeout(1500)  # the server and its MLflow start twice, and a node waits 120 s for its run
def test_a_run_ended_while_mlflow_was_away_gets_its_mlflow_run_once_the_server_is_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hold = tmp_path / "mlflow-may-be-ready"
    monkeypatch.setenv(AIR_MLFLOW_HOLD, str(hold))
    monkeypatch.setenv(AIR_TRACKING_GIVE_UP_S, "3")
    srv = AirServer(home=tmp_path / "server-home", port=free_port(), clients=tmp_path / "clients",
                    log=tmp_path / "server.log", mlflow_port=free_port(), start_args=("--single-trust-domain",))
    srv.home.mkdir()
    srv.tokens = {"alice": srv.token_create("alice"), "root": srv.token_create("root", "--admin")}
    try:
        _start_with_mlflow_held(srv)
        script = tmp_path / "node.py"
        script.write_text(NODE)
        spec = tmp_path / "late.yaml"
        spec.write_text(textwrap.dedent(f"""\
            experiment_name: late-tracking
            compute: {{num_accelerators: 1, accelerator_type: CPU_1xCPU}}
            max_retries: 0
            command: {sys.executable} {script}
        """))
        run_id = srv.air_json("alice", "run", "-f", str(spec))["run_id"]
        srv.wait_status(run_id, "RUNNING", timeout=300)
        srv.stop()  # the server and its MLflow are away; the run goes on and ends meanwhile

        # Its node's `import mlflow` waits for the run (node_hook.HOOK_WAIT_S, 120 s), then logs locally.
        wait_for(lambda: srv.run_status_offline(run_id) == "SUCCESS", f"{run_id} to end while the server is away",
                 timeout=600, interval=1.0)
        tracking_done(run_id, timeout=300, home=srv.home)  # its supervisor gave up waiting and exited
        paths = RunPaths(run_id, srv.home)
        marker = AirHome(srv.home).tracking_pending / run_id
        log = paths.supervisor_log.read_text()
        assert marker.exists(), log
        assert "given up" in log and "tracking pending" in log, log
        assert not paths.tracking(0).exists(), log
        spool = paths.mlflow_hook(0) / "spool"
        assert spool.is_dir() and any(spool.iterdir()), "the node logged nothing locally"

        hold.touch()
        srv.start()  # (returns once its MLflow is ready)
        wait_for(lambda: not marker.exists(), "the back-fill of the marked run and its marker's removal",
                 timeout=600, interval=1.0)
        log = paths.supervisor_log.read_text()
        assert paths.tracking(0).exists(), log
        made = json.loads(paths.tracking(0).read_text())["run_id"]
        assert made in log and "made afterwards (FINISHED)" in log, log

        run = _mlflow(srv, "/api/2.0/mlflow/runs/get", run_id=made)["run"]
        assert run["info"]["status"] == "FINISHED", run
        tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
        assert tags["air.run_id"] == run_id and tags["air.backfilled"] == "true" and tags["air.attempt"] == "0", tags
        history = _mlflow(srv, "/api/2.0/mlflow/metrics/get-history", run_id=made, metric_key="spooled")["metrics"]
        assert sorted((m["step"], m["value"]) for m in history) == [(s, float(s)) for s in range(5)], history
        node_log = _mlflow(srv, "/get-artifact", run_uuid=made, path="logs/attempt_0/node_0.log")
        assert "node done" in node_log, node_log

        # Linked in the store like any attempt's run; made once (a later pass finds nothing to make).
        assert srv.air_json("alice", "get", "run", run_id)["mlflow_run_id"] == made
        experiment = run["info"]["experiment_id"]
        found = _mlflow(srv, "/api/2.0/mlflow/runs/search", {"experiment_ids": [experiment], "max_results": 100,
                                                             "filter": f"tags.`air.run_id` = '{run_id}'"})
        assert [r["info"]["run_id"] for r in found.get("runs", [])] == [made], found
    finally:
        if srv.proc is not None:
            assert srv.stop() == 0, srv.log.read_text()
        try:
            wait_for(lambda: not alive(home_processes(srv.home)), "every process of the server's home to end",
                     timeout=120)
        finally:
            for pid in home_processes(srv.home):
                with suppress(psutil.Error):
                    psutil.Process(pid).kill()


@pytest.mark.timeout(600)
def test_two_backfills_of_one_marked_run_at_once_make_its_mlflow_run_once(air_home: Path, tmp_path: Path) -> None:
    """Two passes (or a pass and reconcile) may start a back-fill of the same marked run before either is
    done: the one holding the marker's lock makes the run, the other makes nothing (real processes, real
    MLflow: the embedded store)."""
    from mlflow import MlflowClient

    from air.tracking.store import tracking_uri

    attempt = tmp_path / "attempt_0"
    attempt.mkdir()
    (attempt / "mlflow_env.json").write_text("{}")  # what a supervisor that gave up writes
    (attempt / "node_0.log").write_text("node 0 was here\n")
    marker = tmp_path / "marker"
    marker.touch()
    job = {"experiment": "twice", "run_name": None, "params_file": str(tmp_path / "none.yaml"),
           "tags": {"air.run_id": "run-x"}, "marker": str(marker),
           "attempts": [{"index": 0, "status": "SUCCESS", "started_at": 1000.0, "ended_at": 2000.0,
                         "ref": str(attempt / "tracking.json"), "spool": str(attempt / "spool"),
                         "node_logs": {"0": str(attempt / "node_0.log")}}]}
    argv = [sys.executable, "-m", "air.tracking.backfill", json.dumps(job)]
    both = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [proc.communicate(timeout=500)[0] for proc in both]
    assert [proc.returncode for proc in both] == [0, 0], outputs
    assert sum("made afterwards (FINISHED)" in out for out in outputs) == 1, outputs
    made = json.loads((attempt / "tracking.json").read_text())["run_id"]
    client = MlflowClient(tracking_uri())
    experiment = client.get_experiment_by_name("twice")
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id], "tags.`air.run_id` = 'run-x'")
    assert [r.info.run_id for r in runs] == [made]
    assert client.get_run(made).info.status == "FINISHED"
    # A third, after the fact (the marker is still there until a server pass removes it): nothing more.
    again = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "made afterwards" not in again.stdout, again.stdout + again.stderr
    assert len(client.search_runs([experiment.experiment_id], "tags.`air.run_id` = 'run-x'")) == 1


def _ended_attempt(store: Any, tracking: dict[str, str] | None = None) -> str:
    """A run whose attempt 0 ended with tracking on and no MLflow run (its supervisor gave up: `{}`), or,
    with `tracking`, whose back-fill already wrote its note."""
    from air.store.states import AttemptStatus

    run = store.create_run(experiment="pass", accelerator_type="CPU_1xCPU", num_accelerators=1, num_nodes=1).run
    store.start_attempt(run.id)
    store.finish_attempt(run.id, 0, AttemptStatus.SUCCESS)
    paths = RunPaths(run.id)
    paths.mlflow_hook(0).mkdir(parents=True)
    paths.mlflow_env(0).write_text("{}")
    (paths.attempt_dir(0) / "node_0.log").write_text("node 0 of the pass\n")
    if tracking is not None:
        paths.tracking(0).write_text(json.dumps(tracking))
    return str(run.id)


@pytest.mark.timeout(600)
def test_the_servers_pass_records_made_runs_drops_stale_markers_and_waits_for_a_living_supervisor(
        air_home: Path) -> None:
    """backfill_pending (what `air server` runs once its MLflow is ready, then every minute) on a real store:
    a made run is linked and its marker removed; markers of no run go; a run whose supervisor still lives
    waits (PENDING_SETTLE_S), then is back-filled (a real detached process, the embedded MLflow)."""
    import os
    import time

    from air.runs.reconcile import PENDING_SETTLE_S, backfill_pending, mark_tracking_pending
    from air.store.run_store import RunStore

    store = RunStore()
    made = _ended_attempt(store, {"run_id": "0123abcd", "experiment_id": "1", "tracking_uri": "http://x/mlflow"})
    waiting = _ended_attempt(store)
    assert not mark_tracking_pending(store, waiting)  # the embedded store is never away: no marker locally
    folder = AirHome().tracking_pending
    folder.mkdir(parents=True)
    for name in (made, waiting, "run-260101-00000000", "not-a-run"):
        (folder / name).touch()
    store.set_supervisor(waiting, os.getpid())  # "its supervisor" lives (this test's process)

    assert backfill_pending(store) == 0
    assert sorted(p.name for p in folder.iterdir()) == [waiting]
    assert store.list_attempts(made)[0].mlflow_run_id == "0123abcd" and store.get_run(made).mlflow_run_id == "0123abcd"
    assert not RunPaths(waiting).tracking(0).exists()

    assert backfill_pending(store, now=time.time() + PENDING_SETTLE_S + 1) == 1  # settled: back-filled
    ref = RunPaths(waiting).tracking(0)
    wait_for(lambda: ref.exists() or "could not" in RunPaths(waiting).supervisor_log.read_text(),
             "the back-fill's tracking note", timeout=400)
    log = RunPaths(waiting).supervisor_log
    assert ref.exists(), log.read_text()
    assert (folder / waiting).exists()  # removed by the next pass once the back-fill let go of it
    wait_for(lambda: backfill_pending(store) == 0 and not (folder / waiting).exists(),
             "a pass to find nothing missing and remove the marker", timeout=120)
    assert "made afterwards (FINISHED)" in log.read_text()
    assert store.list_attempts(waiting)[0].mlflow_run_id == json.loads(ref.read_text())["run_id"]
