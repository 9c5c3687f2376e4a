"""MLflow for every node of a Ray cluster behind `air server`: nodes on other machines (here: Ray nodes
with their own working directory and no access to the server's AIR_HOME) log with plain
`mlflow.log_metric` to the server's MLflow over http."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from server_helpers import running_server  # noqa: E402


def test_ray_nodes_log_to_the_servers_mlflow(ray_cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    config = f"default_profile: cluster\nprofiles:\n  cluster: {{backend: ray, address: '{ray_cluster.address}'}}\n"
    with running_server(tmp_path, mlflow=True, config=config) as server:
        spec = tmp_path / "wl.yaml"
        spec.write_text(
            "experiment_name: ray-metrics\ncompute: {accelerator_type: CPU_1xCPU, num_accelerators: 2}\n"
            "command: |\n"
            "  cd \"$(mktemp -d)\" && export AIR_HOME=\"$PWD/elsewhere\"\n"
            "  python -c \"import mlflow, os; mlflow.log_metric('loss_node_' + os.environ['NODE_RANK'], 1.5)\"\n")
        result = server.air("alice", "run", "-f", str(spec), "--watch", timeout=600)
        assert result.returncode == 0, result.stdout + result.stderr
        run_id = server.air_json("alice", "list", "runs", "--all-status")["runs"][0]["id"]
        detail = server.air_json("alice", "get", "run", run_id)
        assert detail["backend"] == "ray"
        import subprocess

        reader = ("import json, sys, mlflow\n"
                  "print(json.dumps(mlflow.MlflowClient(sys.argv[1]).get_run(sys.argv[2]).data.metrics))\n")
        uri = f"http://127.0.0.1:{server.mlflow_port}"
        read = subprocess.run([sys.executable, "-c", reader, uri, detail["mlflow_run_id"]],
                              env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}, cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
        assert read.returncode == 0, read.stderr
        metrics = json.loads(read.stdout.strip().splitlines()[-1])
        assert metrics.get("loss_node_0") == 1.5 and metrics.get("loss_node_1") == 1.5, metrics
