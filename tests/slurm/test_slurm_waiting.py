"""A run whose nodes wait for its MLflow run says so as its state (issue 35): Slurm's nodes get MLFLOW_RUN_ID
in their environment, so they start once the attempt's MLflow run exists. With the tracking server away,
`air list runs`, `air get run` and the run's page say what the nodes wait for; once a real MLflow server
(`air ui`) answers on that address, the run is made, the nodes start with its id, and the run ends SUCCESS with
nothing left waiting."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from slurm_cluster import SlurmCluster

from air.store.paths import RunPaths
from proc_helpers import wait_for

pytestmark = pytest.mark.timeout(600)


def air(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "air.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_nodes_waiting_for_their_mlflow_run_is_the_runs_visible_state(hpc: SlurmCluster, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    monkeypatch.setenv("AIR_TRACKING", "on")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    spec = tmp_path / "w.yaml"
    spec.write_text("experiment_name: waits\nmax_retries: 0\ncompute: {num_accelerators: 2, accelerator_type: CPU_1xCPU}\n"
                    'command: |\n  echo "run id: $MLFLOW_RUN_ID"\n')
    submitted = air("run", "-f", str(spec), "--json")
    assert submitted.returncode == 0, submitted.stderr
    run_id = str(json.loads(submitted.stdout)["data"]["run_id"])

    def listed() -> str:
        return air("list", "runs").stdout

    wait_for(lambda: "its nodes wait for its MLflow run" in listed(), "the wait in air list runs", timeout=240,
             interval=0.5)
    detail = json.loads(air("get", "run", run_id, "--json").stdout)["data"]
    assert detail["status"] == "RUNNING" and detail["waiting"].startswith("its MLflow run (http://127.0.0.1:"), detail
    assert "Waiting" in air("get", "run", run_id).stdout
    assert not RunPaths(run_id).node_log(0, 0).exists() or "run id" not in RunPaths(run_id).node_log(0, 0).read_text()

    from air.web import create_web_app
    from air.web.serve import PageServer

    pages_port = free_port()
    pages = PageServer(create_web_app(), "127.0.0.1", pages_port)  # the run's page, as `air ui` serves it
    pages.start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{pages_port}/runs/{run_id}", timeout=60) as answer:
            shown = answer.read().decode()
    finally:
        pages.stop()
    assert 'id="run-waiting"' in shown and "Its nodes wait for its MLflow run" in shown, shown[-3000:]

    # A real MLflow server (`air ui`) comes up at the address: the run is made, the nodes start with its id
    ui_env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}  # (it serves this AIR_HOME's store)
    ui_log = tmp_path / "ui.log"
    with open(ui_log, "wb") as out:
        ui = subprocess.Popen([sys.executable, "-m", "air.cli.main", "ui", "--port", str(port)], env=ui_env,
                              stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def ended() -> bool:
            got = json.loads(air("get", "run", run_id, "--json").stdout)["data"]
            return got["status"] not in ("QUEUED", "RUNNING")

        wait_for(ended, "the run to end once MLflow answers", timeout=300, interval=1.0)
        detail = json.loads(air("get", "run", run_id, "--json").stdout)["data"]
        assert detail["status"] == "SUCCESS", (detail, ui_log.read_text()[-3000:])
        assert detail["waiting"] is None and not RunPaths(run_id).waiting.exists()
        for node in (0, 1):
            line = RunPaths(run_id).node_log(0, node).read_text()
            assert "run id: " in line and line.split("run id: ", 1)[1].strip(), line  # started with its id
        assert "its nodes wait" not in listed()
    finally:
        ui.send_signal(signal.SIGINT)
        ui.wait(timeout=60)
