"""A node process that logs a metric through the server's MLflow and exits at once loses nothing (issue 24).

Nodes log asynchronously through an http tracking server (node_hook.py): a short process must still
send its queued metrics before it exits. 20 processes in a row, each logging one metric and exiting at
once, through a real `air server`: all 20 metrics are in the attempt's MLflow run afterwards."""

from __future__ import annotations

import json
import sys
import textwrap
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from server_helpers import AirServer

from proc_helpers import tracking_done

ROUNDS = 20

ONE_METRIC = """\
import sys, time, mlflow
step = int(sys.argv[1])
began = time.time()
mlflow.log_metric("once", float(step), step=step)
print(f"logged {step} in {time.time() - began:.3f} s", flush=True)
"""


def _history(server: AirServer, run_id: str, key: str) -> list[float]:
    query = urllib.parse.urlencode({"run_id": run_id, "metric_key": key, "max_results": 25000})
    request = urllib.request.Request(f"{server.url}/mlflow/api/2.0/mlflow/metrics/get-history?{query}",
                                     headers={"Authorization": f"Bearer {server.tokens['root']}"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        return [m["value"] for m in json.loads(answer.read()).get("metrics", [])]


@pytest.mark.timeout(900)  # 20 interpreters importing mlflow in a row on 2 busy cores
def test_short_processes_that_log_and_exit_at_once_lose_no_metric(mlflow_server: AirServer, tmp_path: Path) -> None:
    server = mlflow_server
    script = tmp_path / "once.py"
    script.write_text(ONE_METRIC)
    spec = tmp_path / "short.yaml"
    spec.write_text(textwrap.dedent(f"""\
        experiment_name: short
        compute: {{num_accelerators: 1, accelerator_type: CPU_1xCPU}}
        command: for i in $(seq 0 {ROUNDS - 1}); do {sys.executable} {script} $i; done
    """))
    run_id = server.air_json("alice", "run", "-f", str(spec))["run_id"]
    assert server.wait_status(run_id, "SUCCESS", "FAILED", timeout=780) == "SUCCESS"

    tracking_done(run_id, home=server.home)  # (an ended run's MLflow id is recorded just after its end)
    mlflow_run = server.air_json("alice", "get", "run", run_id)["mlflow_run_id"]
    assert mlflow_run, "the attempt has no MLflow run"
    logged = sorted(_history(server, mlflow_run, "once"))
    node_log = (server.home / "runs" / run_id / "attempt_0" / "node_0.log").read_text()
    assert logged == [float(i) for i in range(ROUNDS)], (f"{len(logged)} of {ROUNDS} metrics in MLflow: {logged}; "
                                                         f"the node's log:\n{node_log}")
