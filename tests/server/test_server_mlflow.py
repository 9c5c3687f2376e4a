"""MLflow for every node: a metric logged with plain `mlflow.log_metric` in a node's command lands in the
air server's MLflow server, read back over http (through the server's door) by a process that has nothing
but the URI and the user's token."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from server_helpers import AirServer

from proc_helpers import tracking_done


def test_a_nodes_metric_lands_in_the_servers_mlflow(mlflow_server: AirServer, tmp_path: Path) -> None:
    server = mlflow_server
    spec = tmp_path / "wl.yaml"
    spec.write_text(
        "experiment_name: metrics\ncompute: {accelerator_type: CPU_1xCPU, num_accelerators: 2}\n"
        "command: |\n"
        "  python -c \"import mlflow, os; mlflow.log_metric('node_loss_' + os.environ['NODE_RANK'], 0.25)\"\n")
    result = server.air("alice", "run", "-f", str(spec), "--watch", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    run_id = server.air_json("alice", "list", "runs", "--all-status")["runs"][0]["id"]
    tracking_done(run_id, home=server.home)  # (an ended run's MLflow id is recorded just after its end)
    detail = server.air_json("alice", "get", "run", run_id)
    uri = server.url + "/mlflow"  # MLflow is reached through the server's door (its own port is loopback only)
    assert detail["mlflow_url"].startswith(uri + "/#/experiments/"), detail["mlflow_url"]
    reader = ("import json, sys, mlflow\n"
              "run = mlflow.MlflowClient(sys.argv[1]).get_run(sys.argv[2])\n"
              "print(json.dumps(run.data.metrics))\n")
    clean = {"PATH": os.environ["PATH"], "HOME": str(tmp_path / "nobody"), "MLFLOW_TRACKING_URI": uri,
             "MLFLOW_TRACKING_TOKEN": server.tokens["alice"]}
    read = subprocess.run([sys.executable, "-c", reader, uri, detail["mlflow_run_id"]], env=clean,
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert read.returncode == 0, read.stderr
    metrics = json.loads(read.stdout.strip().splitlines()[-1])
    assert metrics.get("node_loss_0") == 0.25 and metrics.get("node_loss_1") == 0.25, metrics


def test_an_mlflow_tracking_uri_in_the_servers_environment_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    from air.server.mlflow_server import mlflow_server

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.team.example:5000")
    with mlflow_server(door="http://127.0.0.1:8765/mlflow", supervisor={}) as (uri, _):  # starts nothing: the team's
        # server is used as it is
        assert uri is None
        assert os.environ["MLFLOW_TRACKING_URI"] == "http://mlflow.team.example:5000"
