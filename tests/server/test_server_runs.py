"""Runs through a real `air server`: they outlive the client and the server, belong to a user, and their
logs stream from the server (issue 14's must-show items on one machine)."""

from __future__ import annotations

import json
import signal
import subprocess
import textwrap
import threading
from pathlib import Path

from server_helpers import AIR, AirServer

from proc_helpers import wait_for

LINES = 5


def gated_workload(folder: Path, gate: Path) -> Path:
    """2 CPU nodes that print, wait until `gate` exists, print again: RUNNING for as long as a test needs."""
    code = folder / "code"
    code.mkdir(parents=True)
    (code / "work.py").write_text(textwrap.dedent(f"""
        import os, pathlib, sys, time
        rank = os.environ["NODE_RANK"]
        for i in range(1, {LINES} + 1):
            print(f"node {{rank}} line {{i}}", flush=True)
        deadline = time.time() + 300
        while not pathlib.Path({str(gate)!r}).exists() and time.time() < deadline:
            time.sleep(0.1)
        print(f"node {{rank}} done", flush=True)
    """))
    spec = folder / "wl.yaml"
    spec.write_text(textwrap.dedent("""
        experiment_name: team
        compute: {accelerator_type: CPU_1xCPU, num_accelerators: 2}
        code_source: {snapshot: {root_path: code}}
        command: python $CODE_SOURCE_PATH/work.py
    """))
    return spec


def expected_lines(node: int) -> list[str]:
    return [f"node {node} line {i}" for i in range(1, LINES + 1)] + [f"node {node} done"]


def test_a_run_outlives_its_watch_and_is_alices(shared_server: AirServer, tmp_path: Path) -> None:
    server = shared_server
    gate = tmp_path / "gate"
    spec = gated_workload(tmp_path / "work", gate)
    watch = subprocess.Popen([*AIR, "run", "-f", str(spec), "--watch", "--json"], env=server.env("alice"),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    events: list[dict[str, object]] = []

    def read() -> None:
        assert watch.stdout is not None
        for line in watch.stdout:
            events.append(json.loads(line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    wait_for(lambda: any(e.get("type") == "STATUS" and e.get("status") == "RUNNING" for e in events),
             "alice's --watch to show RUNNING", timeout=120)
    run_id = str(next(e["run_id"] for e in events if e.get("type") == "SUBMITTED"))
    wait_for(lambda: sum(e.get("type") == "LOG" for e in events) >= 2 * LINES, "node lines through the watch", 60)
    watch.kill()  # SIGKILL: the client is gone, the run is not
    watch.wait(timeout=30)
    assert server.run_status(run_id) == "RUNNING"

    # bob sees it only with --all-users, and may not cancel it
    assert run_id not in [r["id"] for r in server.air_json("bob", "list", "runs")["runs"]]
    everyone = {r["id"]: r for r in server.air_json("bob", "list", "runs", "--all-users")["runs"]}
    assert everyone[run_id]["user"] == "alice"
    denied = server.air("bob", "cancel", run_id)
    assert denied.returncode == 2 and "belongs to alice" in denied.stderr, denied.stderr
    assert server.run_status(run_id) == "RUNNING"
    assert server.api("GET", "/api/v1/runs")[0] == 401  # anonymous

    gate.touch()
    assert server.wait_status(run_id, "SUCCESS", "FAILED", "INTERNAL_ERROR") == "SUCCESS"
    detail = server.air_json("alice", "get", "run", run_id)
    assert detail["user"] == "alice" and detail["status"] == "SUCCESS"
    # The run's backend and profile are the server's, and `air get run` says so (not as alice's own).
    shown = server.air("alice", "get", "run", run_id).stdout
    assert f"local on the server {server.url} (profile on the server: local)" in shown, shown
    node1 = server.air("alice", "logs", run_id, "--node", "1")
    assert node1.returncode == 0, node1.stderr
    assert node1.stdout.splitlines() == expected_lines(1)
    none = server.air("alice", "logs", run_id, "--tail", "0")  # as `tail -n 0`: nothing, and no "is empty"
    assert (none.returncode, none.stdout, none.stderr) == (0, "", ""), none.stderr
    text = server.air("alice", "list", "runs", "--all-users", "--all-status")
    assert "USER" in text.stdout and "alice" in text.stdout


def test_the_server_is_killed_mid_run_and_restarted(server: AirServer, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    spec = gated_workload(tmp_path / "work", gate)
    run_id = server.air_json("alice", "run", "-f", str(spec))["run_id"]
    server.wait_status(run_id, "RUNNING")
    follower = subprocess.Popen([*AIR, "logs", run_id, "--follow"], env=server.env("alice"),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert follower.stdout is not None
    first = follower.stdout.readline()  # following: the server streams
    assert first.startswith("[node "), first
    assert server.stop(signal.SIGKILL) == -signal.SIGKILL
    _, err = follower.communicate(timeout=60)  # the stream broke: the follower says how to reattach
    assert follower.returncode == 1 and f"air logs {run_id} --follow" in err, err
    gate.touch()  # the run goes on without any server
    server.start()
    assert server.wait_status(run_id, "SUCCESS", "FAILED", "INTERNAL_ERROR") == "SUCCESS"
    logs = server.air("alice", "logs", run_id, "--follow")  # reattached after the run ended: every line
    assert logs.returncode == 0, logs.stderr
    for node in (0, 1):
        assert [ln.removeprefix(f"[node {node}] ") for ln in logs.stdout.splitlines()
                if ln.startswith(f"[node {node}] ")] == expected_lines(node)


def test_logs_follow_through_the_server_until_the_run_ends(shared_server: AirServer, tmp_path: Path) -> None:
    server = shared_server
    gate = tmp_path / "gate"
    spec = gated_workload(tmp_path / "work", gate)
    run_id = server.air_json("alice", "run", "-f", str(spec))["run_id"]
    server.wait_status(run_id, "RUNNING")
    follower = subprocess.Popen([*AIR, "logs", run_id, "--node", "0", "--follow"], env=server.env("bob"),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    gate.touch()
    out, err = follower.communicate(timeout=120)
    assert follower.returncode == 0, err
    assert out.splitlines() == expected_lines(0)
    cancel = server.air("root", "cancel", run_id)  # an admin may cancel anyone's run (it already ended)
    assert cancel.returncode == 0, cancel.stderr


def test_logs_download_through_the_server_with_secrets_masked(shared_server: AirServer, tmp_path: Path) -> None:
    server = shared_server
    put = subprocess.run([*AIR, "secrets", "put", "hf", "token"], env=server.env("alice"), input="s3cr3t-value",
                         capture_output=True, text=True, timeout=60)
    assert put.returncode == 0, put.stderr
    spec = tmp_path / "wl.yaml"
    spec.write_text(textwrap.dedent("""
        experiment_name: download
        compute: {accelerator_type: CPU_1xCPU, num_accelerators: 2}
        secrets: {API_TOKEN: hf/token}
        command: |
          echo "node $NODE_RANK token is $API_TOKEN"
          echo "node $NODE_RANK done"
    """))
    run_id = server.air_json("alice", "run", "-f", str(spec))["run_id"]
    assert server.wait_status(run_id, "SUCCESS", "FAILED", "INTERNAL_ERROR") == "SUCCESS"
    target = tmp_path / "download"
    copied = server.air("bob", "logs", run_id, "--download-to", str(target))  # anyone signed in may read a run
    assert copied.returncode == 0 and "Copied 2 log(s) of attempt 0" in copied.stderr, copied.stderr
    assert {p.name: p.read_text() for p in (target / "logs").iterdir()} == {
        f"node_{n}.log": f"node {n} token is ***\nnode {n} done\n" for n in (0, 1)}
    missing = server.air("bob", "logs", "run-260101-0badf00d", "--download-to", str(tmp_path / "nothing"))
    assert missing.returncode == 2 and "not found" in missing.stderr.lower(), missing.stderr
    assert not (tmp_path / "nothing").exists()
    status, _ = server.api("GET", f"/api/v1/runs/{run_id}/logs/node/2", token=server.tokens["bob"])
    assert status == 404
