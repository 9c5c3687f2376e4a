"""The MLflow door and the other names of a run's id (issue 34, review N): MLflow parses a request with
protobuf's JSON rules, which take a field by its JSON name too (`runId` for run_id, `runUuid`, `runIds`), and
reads `run_id or run_uuid`. The door checked only run_id/run_uuid/run_ids: bob named his own run as
`run_uuid` (checked, his) and alice's private run as `runId` (not looked at), and MLflow read and wrote
alice's run. A request that names a run by such a name is refused now (400), nothing forwarded.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from server_helpers import AirServer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from proc_helpers import tracking_done

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_mlflow_door import api, door  # noqa: E402


def _mlflow_run(server: AirServer, user: str, folder: Path) -> str:
    folder.mkdir()
    spec = folder / "wl.yaml"
    spec.write_text("experiment_name: door\ncompute: {accelerator_type: CPU_1xCPU, num_accelerators: 1}\n"
                    f"command: echo {user}-private-line\n")
    result = server.air(user, "run", "-f", str(spec), "--watch", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    run_id = str(server.air_json(user, "list", "runs", "--all-status")["runs"][0]["id"])
    tracking_done(run_id, home=server.home)
    return str(server.air_json(user, "get", "run", run_id)["mlflow_run_id"])


def test_bob_cannot_name_alices_run_by_its_json_name(private_mlflow_server: AirServer, tmp_path: Path) -> None:
    server = private_mlflow_server
    alice_mlflow = _mlflow_run(server, "alice", tmp_path / "alice")
    bob_mlflow = _mlflow_run(server, "bob", tmp_path / "bob")
    bob = server.tokens["bob"]
    # (the door does refuse alice's run by its ordinary name)
    status, raw = door(server, "GET", api("runs/get"), token=bob, query={"run_id": alice_mlflow})
    assert status in (403, 404), (status, raw)
    # (a GET: MLflow reads query parameters by their proto names only, so `runId` there names nothing)
    reads = [("GET", api("runs/get"), None, {"run_uuid": bob_mlflow, "runId": alice_mlflow}),
             ("GET", api("metrics/get-history"), None, {"run_uuid": bob_mlflow, "runId": alice_mlflow,
                                                         "metric_key": "x"})]
    bodies = [
        ("POST", api("runs/get"), {"run_uuid": bob_mlflow, "runId": alice_mlflow}, None),
        ("POST", api("runs/log-metric"), {"run_uuid": bob_mlflow, "runId": alice_mlflow, "key": "bob_was_here",
                                          "value": 1.0, "timestamp": 0, "step": 0}, None),
        ("POST", api("runs/set-tag"), {"run_uuid": bob_mlflow, "runId": alice_mlflow, "key": "bob_was_here",
                                       "value": "yes"}, None),
        ("POST", api("runs/log-batch"), {"run_uuid": bob_mlflow, "runId": alice_mlflow,
                                         "params": [{"key": "bob_was_here", "value": "1"}]}, None),
    ]
    answers = [(method, path, *door(server, method, path, token=bob, body=body, query=query))
               for method, path, body, query in [*reads, *bodies]]
    for method, path, _status, raw in answers:
        assert alice_mlflow.encode() not in raw, f"{method} {path}: bob got alice's run {alice_mlflow}: {raw[:200]!r}"
    # alice's run holds nothing of bob's
    status, raw = door(server, "GET", api("runs/get"), token=server.tokens["alice"], query={"run_id": alice_mlflow})
    assert status == 200, raw
    data = json.loads(raw)["run"]["data"]
    assert "bob_was_here" not in json.dumps(data), data
    for method, path, status, raw in answers[len(reads):]:
        assert status == 400 and b"run_id" in raw, (method, path, status, raw)
