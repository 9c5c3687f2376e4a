"""The API's edges against a real `air server`: tokens, bad requests (a clear 4xx and nothing changed),
per-user secrets that never come back out, a clean stop."""

from __future__ import annotations

import hashlib
import http.client
import signal
import subprocess
from pathlib import Path

from server_helpers import AIR, AirServer, home_processes

from proc_helpers import alive, wait_for


def _state(server: AirServer) -> tuple[list[str], list[str], list[str]]:
    """What a request could have changed: runs, run folders, uploaded snapshots."""
    runs = [r["id"] for r in server.air_json("root", "list", "runs", "--all-users", "--all-status")["runs"]]
    folders = sorted(p.name for p in (server.home / "runs").glob("*")) if (server.home / "runs").exists() else []
    uploads = (sorted(p.name for p in (server.home / "server" / "uploads").glob("*"))
               if (server.home / "server" / "uploads").exists() else [])
    return runs, folders, uploads


def follow_a_sleeping_run(server: AirServer, folder: Path, follower_user: str) -> tuple[str, subprocess.Popen[str]]:
    """alice's run that prints `started` and sleeps, and `air logs --follow` of it as `follower_user`,
    once its first line has come through."""
    spec = folder / "wl.yaml"
    spec.write_text("experiment_name: follow\ncompute: {accelerator_type: CPU_1xCPU, num_accelerators: 1}\n"
                    "command: echo started; sleep 600\n")
    run_id = server.air_json("alice", "run", "-f", str(spec))["run_id"]
    server.wait_status(run_id, "RUNNING")
    follower = subprocess.Popen([*AIR, "logs", run_id, "--follow"], env=server.env(follower_user),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert follower.stdout is not None and follower.stdout.readline() == "started\n"
    return run_id, follower


def test_bad_requests_are_4xx_and_change_nothing(shared_server: AirServer) -> None:
    server = shared_server
    alice = server.tokens["alice"]
    before = _state(server)
    good = {"experiment_name": "x", "compute": {"accelerator_type": "CPU_1xCPU", "num_accelerators": 1},
            "command": "echo hi"}

    assert server.api("GET", "/api/v1/health")[0] == 200
    assert server.api("GET", "/api/v1/runs", token="air_not-a-token")[0] == 401
    status, body = server.api("POST", "/api/v1/runs", token=alice, body={"spec": {**good, "compute": "lots"}})
    assert status == 400 and "compute" in body["error"]["message"], body
    status, body = server.api("POST", "/api/v1/runs", token=alice, data=b"{not json")
    assert status == 400 and "not JSON" in body["error"]["message"]
    content = b"print('x')\n"
    digest = hashlib.sha256(content).hexdigest()
    for bad_path in ("../escape.py", "/etc/passwd", "a/../../b", ".git/config"):
        manifest = {"name": "code", "files": [{"path": bad_path, "mode": "100644", "sha256": digest}]}
        status, body = server.api("POST", "/api/v1/runs", token=alice, body={
            "spec": {**good, "code_source": {"snapshot": {"root_path": "."}}}, "snapshot": manifest})
        assert status == 400 and "snapshot" in body["error"]["message"].lower(), (bad_path, body)
    link = {"name": "code", "files": [{"path": "l", "mode": "120000", "target": "../../etc/passwd"}]}
    status, body = server.api("POST", "/api/v1/runs", token=alice, body={
        "spec": {**good, "code_source": {"snapshot": {"root_path": "."}}}, "snapshot": link})
    assert status == 400 and "points out of the snapshot" in body["error"]["message"]
    status, body = server.api("PUT", f"/api/v1/blobs/{digest}", token=alice, data=b"other content")
    assert status == 400 and "hashes to" in body["error"]["message"]
    assert server.api("PUT", "/api/v1/blobs/../../x", token=alice)[0] in (400, 404)

    # a 2 GB upload is refused from its Content-Length, before any byte of it is read
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.putrequest("PUT", f"/api/v1/blobs/{digest}")
    conn.putheader("Authorization", f"Bearer {alice}")
    conn.putheader("Content-Length", str(2 << 30))
    conn.endheaders()
    response = conn.getresponse()
    assert response.status == 413 and b"larger than the server accepts" in response.read()
    conn.close()

    missing = "run-260101-0badf00d"
    assert server.api("GET", f"/api/v1/runs/{missing}", token=alice)[0] == 404
    assert server.api("POST", f"/api/v1/runs/{missing}/cancel", token=alice)[0] == 404
    assert server.api("GET", "/api/v1/runs/..%2f..%2fetc", token=alice)[0] in (400, 404)
    status, body = server.api("GET", f"/api/v1/runs/{missing}/follow", token=alice)
    assert status == 404 and body["error"]["code"] == "NOT_FOUND"
    assert _state(server) == before
    assert not list((server.home / "server" / "blobs").glob("[0-9a-f]*"))

    # and the CLI says so with exit code 2, as locally
    result = server.air("alice", "get", "run", missing)
    assert result.returncode == 2 and "not found" in result.stderr.lower(), result.stderr
    spec = server.clients / "wl.yaml"
    spec.parent.mkdir(parents=True, exist_ok=True)
    spec.write_text("experiment_name: x\ncompute: {accelerator_type: CPU_1xCPU, num_accelerators: 2}\n"
                    "command: echo hi\n")
    wrong_node = server.air("alice", "run", "-f", str(spec), "--watch", "--node", "2")
    assert wrong_node.returncode == 2 and "the workload has 2 node(s)" in wrong_node.stderr, wrong_node.stderr
    dry = server.air_json("alice", "run", "-f", str(spec), "--dry-run")  # planned by the server, nothing made
    assert dry["status"] == "DRY_RUN_OK" and dry["plan"]["profile"] == "local", dry
    assert _state(server) == before


def test_tokens_users_and_secrets(shared_server: AirServer, tmp_path: Path) -> None:
    server = shared_server
    listed = subprocess.run([*AIR, "server", "token", "list", "--json"], env=server.server_env(),
                            capture_output=True, text=True, timeout=60)
    tokens = {t["user"]: t for t in __import__("json").loads(listed.stdout)["data"]["tokens"]}
    assert set(tokens) == {"alice", "bob", "root"} and tokens["root"]["admin"] and not tokens["bob"]["admin"]
    assert all(server.tokens[u] not in listed.stdout for u in tokens)  # never shown again
    stored = (server.home / "runs.db").read_bytes()
    assert server.tokens["alice"].encode() not in stored  # only its hash is kept

    put = subprocess.run([*AIR, "secrets", "put", "hf", "token"], env=server.env("alice"), input="s3cr3t-value",
                         capture_output=True, text=True, timeout=60)
    assert put.returncode == 0, put.stderr
    assert server.air_json("alice", "secrets", "list")["secrets"] == [{"scope": "hf", "key": "token"}]
    assert server.air_json("bob", "secrets", "list")["secrets"] == []
    status, body = server.api("GET", "/api/v1/secrets", token=server.tokens["alice"])
    assert status == 200 and "s3cr3t-value" not in str(body)

    # Revoking bob's token refuses his next request and ends the log stream he has open.
    run_id, follower = follow_a_sleeping_run(server, tmp_path, "bob")
    revoked = subprocess.run([*AIR, "server", "token", "revoke", "bob"], env=server.server_env(),
                             capture_output=True, text=True, timeout=60)
    assert revoked.returncode == 0, revoked.stderr
    _, err = follower.communicate(timeout=30)
    assert follower.returncode == 2 and "no longer valid" in err, err
    denied = server.air("bob", "list", "runs")
    assert denied.returncode == 2 and "valid air token" in denied.stderr, denied.stderr
    assert server.air("alice", "cancel", run_id).returncode == 0


def test_the_server_stops_cleanly_with_a_follower_attached(server: AirServer, tmp_path: Path) -> None:
    run_id, follower = follow_a_sleeping_run(server, tmp_path, "alice")
    server_pid = server.proc.pid if server.proc else 0
    assert server.stop(signal.SIGTERM) == 0  # not held up by the open stream
    assert not alive([server_pid])
    _, err = follower.communicate(timeout=60)
    assert follower.returncode == 1 and "reattach" in err, err
    assert server.run_status_offline(run_id) == "RUNNING"  # the run is not the server's process
    server.start()
    cancel = server.air("alice", "cancel", run_id)
    assert cancel.returncode == 0 and "CANCELED" in cancel.stderr, cancel.stderr
    wait_for(lambda: len(home_processes(server.home)) == 1, "only the server to be left", timeout=60)


def test_https_with_a_certificate(tmp_path: Path) -> None:
    from server_helpers import running_server

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    made = subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                           "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key),
                           "-out", str(cert)], capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    with running_server(tmp_path, tls=(cert, key)) as server:
        assert server.url.startswith("https://")
        assert server.api("GET", "/api/v1/runs")[0] == 401
        assert server.air_json("alice", "list", "runs")["runs"] == []  # the CLI trusts it via SSL_CERT_FILE
        untrusted = {k: v for k, v in server.env("alice").items() if k != "SSL_CERT_FILE"}
        refused = subprocess.run([*AIR, "list", "runs"], env=untrusted, capture_output=True, text=True, timeout=60)
        assert refused.returncode == 1 and "SSL_CERT_FILE" in refused.stderr, refused.stderr
