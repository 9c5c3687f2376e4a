"""MLflow for every node of a Ray cluster behind `air server`: nodes on other machines (here: Ray nodes
with their own working directory and no access to the server's AIR_HOME, one of them joined from another
folder with another AIR_HOME) log with plain `mlflow.log_metric` to the server's MLflow over http."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from server_helpers import AirServer, running_server


def test_ray_nodes_log_to_the_servers_mlflow(ray_cluster, tmp_path: Path,  # type: ignore[no-untyped-def]
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    config = f"default_profile: cluster\nprofiles:\n  cluster: {{backend: ray, address: '{ray_cluster.address}'}}\n"
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "air-home").mkdir(parents=True)
    with monkeypatch.context() as here:  # a 4th node, joined from another folder with another AIR_HOME
        here.chdir(elsewhere)
        node = ray_cluster.add_node(num_cpus=2, env={**os.environ, "AIR_HOME": str(elsewhere / "air-home")})
    try:
        raylets = [p for p in node.processes() if "raylet" in " ".join(p.cmdline())]
        assert raylets and all(p.cwd() == str(elsewhere) and p.environ()["AIR_HOME"] == str(elsewhere / "air-home")
                               for p in raylets)
        with running_server(tmp_path, mlflow=True, config=config) as server:
            _four_nodes_log_metrics(server, tmp_path)
    finally:
        node.stop(grace_s=2.0)
        ray_cluster.nodes.remove(node)


def _four_nodes_log_metrics(server: AirServer, tmp_path: Path) -> None:
    """One node on each of the cluster's 4 nodes (Ray spreads a run's nodes over distinct Ray nodes), the
    one joined from elsewhere included; a node's command also moves to a fresh folder and AIR_HOME."""
    spec = tmp_path / "wl.yaml"
    spec.write_text(
        "experiment_name: ray-metrics\ncompute: {accelerator_type: CPU_1xCPU, num_accelerators: 4}\n"
        "command: |\n"
        "  cd \"$(mktemp -d)\" && export AIR_HOME=\"$PWD/elsewhere\"\n"
        "  python -c \"import mlflow, os; mlflow.log_metric('loss_node_' + os.environ['NODE_RANK'], 1.5)\"\n")
    result = server.air("alice", "run", "-f", str(spec), "--watch", timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    run_id = server.air_json("alice", "list", "runs", "--all-status")["runs"][0]["id"]
    detail = server.air_json("alice", "get", "run", run_id)
    assert detail["backend"] == "ray"
    reader = ("import json, sys, mlflow\n"
              "print(json.dumps(mlflow.MlflowClient(sys.argv[1]).get_run(sys.argv[2]).data.metrics))\n")
    uri = server.url + "/mlflow"  # MLflow listens on no port: the door, with an admin's token
    read = subprocess.run([sys.executable, "-c", reader, uri, detail["mlflow_run_id"]],
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
                               "MLFLOW_TRACKING_TOKEN": server.tokens["root"]}, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert read.returncode == 0, read.stderr
    metrics = json.loads(read.stdout.strip().splitlines()[-1])
    assert all(metrics.get(f"loss_node_{rank}") == 1.5 for rank in range(4)), metrics
