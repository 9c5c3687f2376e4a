"""Secrets never appear, on a real `air server` (issue 22): alice's run prints her server-side secret in a
200 KiB line and in its last error line, exits 1, and its node log goes to the server's MLflow as an
artifact; afterwards only her secret store under the server's AIR_HOME holds the value, and everything she
is shown (the reason, `--json`, `air logs`, downloads, the follow stream) says ***."""

from __future__ import annotations

import json
import subprocess
import textwrap
import uuid
from pathlib import Path

import pytest
from server_helpers import AIR, AirServer

from proc_helpers import tracking_done
from secret_leaks import LEAKY_PROGRAM
from secret_leaks import LEAKY_REASON as REASON


def grep_home(home: Path, needle: str) -> list[str]:
    found = subprocess.run(["grep", "-a", "-r", "-l", needle, str(home)], capture_output=True, text=True)
    assert found.returncode in (0, 1), found.stderr
    return sorted(found.stdout.split())


@pytest.mark.parametrize("server", ["mlflow"], indirect=True)
def test_a_leaky_run_leaves_its_secret_only_in_the_users_store(server: AirServer, tmp_path: Path) -> None:
    secret = f"AIRLEAK{uuid.uuid4().hex[:16]}Z"
    put = subprocess.run([*AIR, "secrets", "put", "team", "token"], env=server.env("alice"), input=secret,
                         capture_output=True, text=True, timeout=60)
    assert put.returncode == 0, put.stderr
    spec = tmp_path / "leaky.yaml"
    spec.write_text("experiment_name: secret-walls\n"
                    "compute: {accelerator_type: CPU_1xCPU, num_accelerators: 1}\n"
                    "max_retries: 0\n"
                    "secrets: {API_TOKEN: team/token}\n"
                    "command: |\n"
                    "  python - <<'PY'\n" + textwrap.indent(LEAKY_PROGRAM, "  ") + "  PY\n")
    watched = server.air("alice", "run", "-f", str(spec), "--watch", "--json", timeout=300)
    assert watched.returncode == 1, watched.stdout + watched.stderr
    assert secret not in watched.stdout + watched.stderr
    events = [json.loads(line) for line in watched.stdout.splitlines()]
    run_id = events[0]["run_id"]
    assert events[-1]["type"] == "TERMINAL" and events[-1]["reason"] == REASON, events[-1]
    assert any(e.get("line") == "starting with token ***" for e in events)
    tracking_done(run_id, home=server.home)  # its MLflow run is ended (node log uploaded) just after the run's end

    found = grep_home(server.home, secret)
    assert len(found) == 1 and found[0].endswith("/users/alice/secrets.json"), found
    assert grep_home(server.home, secret[:12]) == found  # not half of one either
    artifacts = [p for p in server.home.rglob("node_0.log") if "artifacts" in p.parts]
    assert len(artifacts) == 1 and b"ERROR: login refused for token ***" in artifacts[0].read_bytes(), artifacts
    assert artifacts[0].read_bytes().count(b"***") >= 7

    detail = server.air_json("alice", "get", "run", run_id)
    assert detail["termination_reason"] == REASON
    shown = server.air("alice", "get", "run", run_id)
    assert REASON in shown.stdout and secret not in shown.stdout
    logs = server.air("alice", "logs", run_id)
    assert logs.returncode == 0 and "ERROR: login refused for token ***" in logs.stdout
    assert secret not in logs.stdout + logs.stderr
    logs_json = server.air("alice", "logs", run_id, "--json")
    assert logs_json.returncode == 0 and secret not in logs_json.stdout and "***" in logs_json.stdout
    copied = server.air("alice", "logs", run_id, "--download-to", str(tmp_path / "dl"))
    assert copied.returncode == 0, copied.stderr
    downloaded = (tmp_path / "dl" / "logs" / "node_0.log").read_bytes()
    assert b"ERROR: login refused for token ***" in downloaded and secret.encode() not in downloaded
    assert grep_home(server.home, secret) == found  # reading it all back wrote no copy anywhere
