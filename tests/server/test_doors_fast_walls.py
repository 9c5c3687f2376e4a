"""Nodes never wait for their MLflow run under isolation (issue 34): a walled-in node starts before its
attempt's MLflow run exists, and what it logs still lands in that run, through the door, once it is made.

A real root `air server` in `unix-user+bwrap` mode with its MLflow; AIR_MLFLOW_HOLD keeps that MLflow
"starting" (the door answers 503) until the test lets it be ready, so the order is certain however loaded
the machine is: while MLflow is held, no MLflow run can exist. bob's node prints its first line (which
the test waits for while MLflow is held: before the fix, a walled node started only once its run existed,
so it never came), then `import mlflow` waits (the node hook) until the run is made, and its metric lands in
the attempt's own run. The walls hold meanwhile: the node runs as bob's account, sees its hook's folder
read-only and nothing else of the attempt's folder, and has no spool of its own for the server to read.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_helpers import AIR, AirServer, free_port, home_processes

from air.settings import AIR_MLFLOW_HOLD
from air.store.paths import RunPaths
from proc_helpers import alive, wait_for

NODE = r'''
import json, os, sys
print("FIRST LINE uid=%d" % os.getuid(), flush=True)
hook = os.environ["PYTHONPATH"].split(os.pathsep)[0]  # (air's node hook comes first)
seen = {"hook_listed": sorted(os.listdir(hook)), "attempt_listed": sorted(os.listdir(os.path.dirname(hook)))}
try:
    with open(os.path.join(hook, "mine.txt"), "w") as fh:
        fh.write("x")
    seen["hook_write"] = "WROTE"
except OSError as exc:
    seen["hook_write"] = type(exc).__name__
print("SEEN " + json.dumps(seen), flush=True)
import mlflow
mlflow.log_metric("walled", 7.0, step=3)
print("RUN " + mlflow.active_run().info.run_id, flush=True)
'''


def _mlflow_state(srv: AirServer) -> str | None:
    try:
        with urllib.request.urlopen(srv.url + "/api/v1/health", timeout=5) as answer:
            return str(json.loads(answer.read())["mlflow"]["state"])
    except (OSError, ValueError, KeyError):
        return None


def _door(srv: AirServer, user: str, endpoint: str, **query: Any) -> Any:
    """GET through the server's MLflow door with `user`'s token."""
    url = f"{srv.url}/mlflow{endpoint}?{urllib.parse.urlencode(query)}"
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {srv.tokens[user]}"})
    with urllib.request.urlopen(request, timeout=60) as answer:  # the test's own server on loopback
        return json.loads(answer.read())


@pytest.fixture
def held(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[AirServer, Path]]:
    """A root server with isolation on (its default) whose MLflow stays "starting" until the file is made."""
    hold = tmp_path / "mlflow-may-be-ready"
    monkeypatch.setenv(AIR_MLFLOW_HOLD, str(hold))
    srv = AirServer(home=tmp_path / "server-home", port=free_port(), clients=tmp_path / "clients",
                    log=tmp_path / "server.log", mlflow_port=free_port(), start_args=())
    srv.home.mkdir()
    srv.tokens = {"bob": srv.token_create("bob"), "root": srv.token_create("root", "--admin")}
    with open(srv.log, "ab") as log:
        srv.proc = subprocess.Popen([*AIR, "server", "start", "--port", str(srv.port), "--mlflow-port",
                                     str(srv.mlflow_port)], env=srv.server_env(), stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: _mlflow_state(srv) == "starting", f"the server's API with MLflow held (log: {srv.log})",
                 timeout=240)
        yield srv, hold
    finally:
        hold.touch()
        code = srv.stop()
        assert code == 0, f"exit code {code}: {srv.log.read_text()}"
        wait_for(lambda: not alive(home_processes(srv.home)), "every process of the server's home to end",
                 timeout=60)


@pytest.mark.timeout(900)
def test_a_walled_node_starts_before_its_mlflow_run_exists_and_its_metric_lands_in_that_run(
        held: tuple[AirServer, Path], tmp_path: Path) -> None:
    srv, hold = held
    assert srv.api("GET", "/api/v1/health")[1]["isolation"] == "unix-user+bwrap"
    code = tmp_path / "code"
    code.mkdir()
    (code / "main.py").write_text(NODE)
    spec = tmp_path / "wl.yaml"
    spec.write_text(textwrap.dedent("""
        experiment_name: fast-walls
        compute: {accelerator_type: CPU_1xCPU, num_accelerators: 1}
        code_source: {snapshot: {root_path: code}}
        max_retries: 0
        command: python $CODE_SOURCE_PATH/main.py
    """))
    run_id = str(srv.air_json("bob", "run", "-f", str(spec))["run_id"])
    paths = RunPaths(run_id, srv.home)
    log = paths.node_log(0, 0)

    # MLflow is held, so no MLflow run can exist; the walled node starts anyway.
    wait_for(lambda: log.exists() and "FIRST LINE" in log.read_text(),
             f"bob's walled node to start while its MLflow run cannot exist yet (see {paths.supervisor_log})",
             timeout=300)
    assert _mlflow_state(srv) == "starting", "MLflow was no longer held (it waits 180 s at most): " + srv.log.read_text()
    assert not paths.mlflow_env(0).exists(), "the attempt's MLflow run was made while MLflow was held"
    assert srv.api("GET", f"/api/v1/runs/{run_id}", token=srv.tokens["root"])[1].get("mlflow_run_id") is None
    text = log.read_text()
    assert "FIRST LINE uid=0" not in text, text  # the node is bob's account, not the server's
    assert "RUN " not in text, text  # its `import mlflow` waits for the run

    hold.touch()
    assert srv.wait_status(run_id, "SUCCESS", "FAILED", "INTERNAL_ERROR", timeout=600) == "SUCCESS", log.read_text()
    text = log.read_text()
    print(text)
    seen = json.loads(next(line.split("SEEN ", 1)[1] for line in text.splitlines() if "SEEN " in line))
    # Its view shows the hook's folder read-only, and nothing else of the attempt's folder (no node logs,
    # no progress file); it may not write there (the server's account reads nothing a walled node writes).
    assert "sitecustomize.py" in seen["hook_listed"], seen
    assert "mlflow_hook" in seen["attempt_listed"], seen
    assert not {"node_0.log", "progress.json", "mlflow_env.json"} & set(seen["attempt_listed"]), seen
    assert seen["hook_write"] in ("OSError", "PermissionError"), seen
    assert not (paths.mlflow_hook(0) / "spool").exists()

    # The metric it logged lands in the attempt's own MLflow run, made after the node started.
    wait_for(lambda: srv.api("GET", f"/api/v1/runs/{run_id}", token=srv.tokens["root"])[1].get("mlflow_run_id"),
             "the attempt's MLflow run id in the store", timeout=300)
    mlflow_run = str(srv.api("GET", f"/api/v1/runs/{run_id}", token=srv.tokens["root"])[1]["mlflow_run_id"])
    assert f"RUN {mlflow_run}" in text, text
    run = _door(srv, "bob", "/api/2.0/mlflow/runs/get", run_id=mlflow_run)["run"]
    assert {m["key"]: m["value"] for m in run["data"].get("metrics", [])}.get("walled") == 7.0, run
    assert {t["key"]: t["value"] for t in run["data"]["tags"]}["air.run_id"] == run_id, run
    history = _door(srv, "bob", "/api/2.0/mlflow/metrics/get-history", run_id=mlflow_run, metric_key="walled")
    assert [(m["value"], m["step"]) for m in history["metrics"]] == [(7.0, 3)], history
