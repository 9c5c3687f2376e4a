"""MLflow behind the air server's tokens (issue 22): MLflow listens on a Unix socket in a 0700 folder
of the server's account (no TCP port at all) and is served under `/mlflow` by the air server; nothing passes without a token; a run's credential writes to its own run's
MLflow runs and nothing else; the MLflow user of a run is its air user. Real server, real runs, real
MLflow client in the nodes."""

from __future__ import annotations

import http.client
import json
import os
import socket
import ssl
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest
from server_helpers import AIR, AirServer, running_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from proc_helpers import tracking_done, wait_for

#: Every run here is private: bob may not even see alice's runs.


def door(server: AirServer, method: str, path: str, *, token: str | None = None, body: Any = None,
         query: dict[str, str] | None = None) -> tuple[int, bytes]:
    """One request to the server's `/mlflow` door: (status, raw body)."""
    url = server.url + "/mlflow" + path + ("?" + urllib.parse.urlencode(query) if query else "")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    context = ssl.create_default_context(cafile=str(server.tls[0])) if server.tls else None
    try:
        with urllib.request.urlopen(request, timeout=60, context=context) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def api(path: str) -> str:
    return "/api/2.0/mlflow/" + path


def tags_of(server: AirServer, token: str, mlflow_run_id: str) -> dict[str, str]:
    status, raw = door(server, "GET", api("runs/get"), token=token, query={"run_id": mlflow_run_id})
    assert status == 200, raw
    return {t["key"]: t["value"] for t in json.loads(raw)["run"]["data"]["tags"]}


ALICE_NODE = """\
command: |
  python - <<'EOF'
  import os, mlflow
  print("door:", os.environ["MLFLOW_TRACKING_URI"], os.environ["MLFLOW_TRACKING_TOKEN"][:7])
  held = [k for k in ("AIR_SUPERVISOR_ONLY", "MLFLOW_TRACKING_INSECURE_TLS", "MLFLOW_TRACKING_SERVER_CERT_PATH")
          if k in os.environ]
  print("supervisor-only variables held:", held)
  print("token in full:", os.environ["MLFLOW_TRACKING_TOKEN"])
  open(os.environ["TOKEN_OUT"], "w").write(os.environ["MLFLOW_TRACKING_TOKEN"]) if "TOKEN_OUT" in os.environ else None
  mlflow.log_metric("node_loss", 0.25)
  print("alice's node log line")
  EOF
"""

BOB_NODE = """\
command: |
  python - <<'EOF'
  import json, os, pathlib, time, mlflow
  out = pathlib.Path({out!r})
  run = os.environ["MLFLOW_RUN_ID"]  # (MLflow's end_run of the nested run below unsets it)
  mlflow.log_metric("bob_loss", 0.5)
  with mlflow.start_run(nested=True) as child:
      mlflow.log_metric("inner", 1.0)
  out.joinpath("bob.json.tmp").write_text(json.dumps({{
      "token": os.environ["MLFLOW_TRACKING_TOKEN"], "uri": os.environ["MLFLOW_TRACKING_URI"],
      "run": run, "child": child.info.run_id}}))
  out.joinpath("bob.json.tmp").rename(out / "bob.json")
  deadline = time.time() + 600
  while not out.joinpath("release").exists() and time.time() < deadline:
      time.sleep(0.2)
  EOF
"""


def submit(server: AirServer, user: str, spec: Path, body: str, *extra: str) -> str:
    spec.write_text("experiment_name: door\ncompute: {accelerator_type: CPU_1xCPU, num_accelerators: 1}\n" + body)
    result = server.air(user, "run", "-f", str(spec), *extra, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return str(server.air_json(user, "list", "runs", "--all-status")["runs"][0]["id"])


def test_mlflow_only_through_the_door_with_the_right_token(private_mlflow_server: AirServer, tmp_path: Path) -> None:
    server = private_mlflow_server
    alice, bob, root = (server.tokens[u] for u in ("alice", "bob", "root"))
    out = tmp_path / "bob-out"
    out.mkdir()
    bob_run = submit(server, "bob", tmp_path / "bob.yaml", BOB_NODE.format(out=str(out)))
    alice_run = submit(server, "alice", tmp_path / "alice.yaml", ALICE_NODE, "--watch")
    assert server.run_status(alice_run) == "SUCCESS"
    wait_for((out / "bob.json").exists, "bob's node to write its MLflow credential", timeout=300)
    bob_node = json.loads((out / "bob.json").read_text())
    credential = bob_node["token"]
    assert bob_node["uri"] == server.url + "/mlflow" and credential.startswith("airrun_"), bob_node
    tracking_done(alice_run, home=server.home)  # (the ended run's MLflow id is recorded just after its end)
    alice_mlflow = server.air_json("alice", "get", "run", alice_run)["mlflow_run_id"]
    node_log = {"run_uuid": alice_mlflow, "path": "logs/attempt_0/node_0.log"}

    # No token: nothing of MLflow answers.
    for method, path, query in (("GET", api("runs/get"), {"run_id": alice_mlflow}), ("GET", "/get-artifact", node_log),
                                ("GET", "/", None), ("POST", api("experiments/search"), None)):
        status, raw = door(server, method, path, query=query, body={} if method == "POST" else None)
        assert status == 401, (path, status, raw)
    status, _ = door(server, "GET", api("runs/get"), token="airrun_forged", query={"run_id": alice_mlflow})
    assert status == 401

    # Bob's run credential against alice's run: refused, and alice's run is untouched.
    metric = {"run_id": alice_mlflow, "key": "node_loss", "value": 99.0, "timestamp": 0, "step": 0}
    for method, path, body, query in (
            ("POST", api("runs/log-metric"), metric, None),
            ("GET", "/get-artifact", None, node_log),
            ("GET", api("runs/get"), None, {"run_id": alice_mlflow}),
            ("POST", api("runs/set-tag"), {"run_id": alice_mlflow, "key": "x", "value": "y"}, None),
            ("GET", f"/api/2.0/mlflow-artifacts/artifacts/0/{alice_mlflow}/artifacts/logs/attempt_0/node_0.log",
             None, None)):
        status, raw = door(server, method, path, token=credential, body=body, query=query)
        assert status in (403, 404), (path, status, raw)
        assert b"alice's node log line" not in raw
    # Nor by a repeated key (MLflow reads the first value) or an escaped path into her artifacts.
    status, raw = door(server, "GET", f"/get-artifact?run_uuid={alice_mlflow}&run_uuid={bob_node['run']}"
                       "&path=logs/attempt_0/node_0.log", token=credential)
    assert status in (403, 404) and b"alice's node log line" not in raw, (status, raw)
    for path in (f"1/{bob_node['run']}/artifacts/%252e%252e/%252e%252e/{alice_mlflow}/artifacts/x.txt",
                 f"1/{bob_node['run']}/artifacts/../../{alice_mlflow}/artifacts/x.txt"):
        request = urllib.request.Request(f"{server.url}/mlflow/api/2.0/mlflow-artifacts/artifacts/{path}",
                                         data=b"forged", method="PUT",
                                         headers={"Authorization": f"Bearer {credential}"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=60)  # the test's own server
        assert refused.value.code in (400, 403, 404), path
    # Bob's own token cannot see alice's private run either (404: its existence is not told).
    status, raw = door(server, "GET", "/get-artifact", token=bob, query=node_log)
    assert status == 404, raw
    # Nor may a credential claim another run by tag, or call what the door cannot scope.
    status, raw = door(server, "POST", api("runs/set-tag"), token=credential,
                       body={"run_id": bob_node["run"], "key": "air.run_id", "value": alice_run})
    assert status == 403, raw
    status, raw = door(server, "POST", api("experiments/delete"), token=credential, body={"experiment_id": "0"})
    assert status == 403, raw
    status, raw = door(server, "POST", api("registered-models/create"), token=bob, body={"name": "m"})
    assert status == 403, raw

    # Alice reads her node's metric back (logged by plain mlflow.log_metric through the door), and her log.
    status, raw = door(server, "GET", api("metrics/get-history"), token=alice,
                       query={"run_id": alice_mlflow, "metric_key": "node_loss"})
    assert status == 200, raw
    assert [m["value"] for m in json.loads(raw)["metrics"]] == [0.25]
    # (the node log is uploaded right after the run's SUCCESS, by its supervisor)
    status, raw = wait_for(lambda: (lambda got: got if got[0] == 200 else None)(
        door(server, "GET", "/get-artifact", token=alice, query=node_log)), "alice's node log in MLflow", timeout=300)
    assert status == 200 and b"alice's node log line" in raw, raw
    # The run's MLflow user is the air user; so is that of a run bob's code created itself.
    assert tags_of(server, alice, alice_mlflow)["mlflow.user"] == "alice"
    assert tags_of(server, root, bob_node["run"])["mlflow.user"] == "bob"
    child = tags_of(server, root, bob_node["child"])
    assert child["mlflow.user"] == "bob" and child["air.run_id"] == bob_run, child
    # With the right credential a write works and reads back; a search sees only the run's own MLflow runs.
    metric = {"run_id": bob_node["run"], "key": "from_test", "value": 7.0, "timestamp": 0, "step": 0}
    status, raw = door(server, "POST", api("runs/log-metric"), token=credential, body=metric)
    assert status == 200, raw
    status, raw = door(server, "GET", api("runs/get"), token=credential, query={"run_id": bob_node["run"]})
    metrics = {m["key"]: m["value"] for m in json.loads(raw)["run"]["data"]["metrics"]}
    assert metrics["bob_loss"] == 0.5 and metrics["from_test"] == 7.0, metrics
    status, raw = door(server, "GET", api("experiments/get-by-name"), token=credential,
                       query={"experiment_name": "door"})
    assert status == 200, raw
    experiment = json.loads(raw)["experiment"]["experiment_id"]
    # Malformed tags are refused as such (400), never a server error, and nothing is written.
    for op, body in (("runs/log-batch", {"run_id": bob_node["run"], "tags": 5, "metrics": [
                         {"key": "malformed", "value": 1.0, "timestamp": 0, "step": 0}]}),
                     ("runs/create", {"experiment_id": experiment, "tags": {"key": "a", "value": "b"}})):
        status, raw = door(server, "POST", api(op), token=credential, body=body)
        assert status == 400 and b"tags" in raw, (op, status, raw)
    status, raw = door(server, "GET", api("runs/get"), token=credential, query={"run_id": bob_node["run"]})
    assert status == 200 and "malformed" not in {m["key"] for m in json.loads(raw)["run"]["data"]["metrics"]}
    # Its own artifacts go up through the door (proxied: nothing is written into the server's folders by
    # the node) and bob reads them back with his own token.
    own = f"{server.url}/mlflow/api/2.0/mlflow-artifacts/artifacts/{experiment}/{bob_node['run']}/artifacts/note.txt"
    with urllib.request.urlopen(urllib.request.Request(own, data=b"bob's note", method="PUT", headers={
            "Authorization": f"Bearer {credential}"}), timeout=60) as answer:
        assert answer.status == 200
    status, raw = door(server, "GET", "/get-artifact", token=bob, query={"run_uuid": bob_node["run"], "path": "note.txt"})
    assert status == 200 and raw == b"bob's note", (status, raw)
    status, raw = door(server, "POST", api("runs/search"), token=credential, body={"experiment_ids": [experiment]})
    assert status == 200, raw
    found = {r["info"]["run_id"] for r in json.loads(raw).get("runs", [])}
    assert found and found <= {bob_node["run"], bob_node["child"]}, found
    status, raw = door(server, "POST", api("runs/search"), token=root, body={"experiment_ids": [experiment]})
    assert alice_mlflow in {r["info"]["run_id"] for r in json.loads(raw)["runs"]}

    # MLflow listens on no TCP port at all (the old loopback port included): only on its Unix socket, in a
    # folder of the server's account alone. The server said --mlflow-port is no longer a port.
    tree = mlflow_tree(server)
    # Nor does it run MLflow's job runner (8 more processes, ~1.7 GB, for GenAI jobs no training run uses).
    assert not [p.cmdline() for p in tree if "mlflow.server.jobs" in " ".join(p.cmdline())], tree
    listening = [c for p in tree for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    assert not listening, listening
    sockets = [c.laddr for p in tree for c in p.net_connections(kind="unix") if c.laddr]
    assert str(server.mlflow_socket()) in sockets, sockets
    if len(str(server.home / "server" / "mlflow" / "mlflow.sock")) <= 107:  # else a temporary folder's
        assert server.mlflow_socket() == server.home / "server" / "mlflow" / "mlflow.sock"
    folder = os.stat(server.mlflow_socket().parent)
    assert folder.st_mode & 0o777 == 0o700 and folder.st_uid == os.getuid(), oct(folder.st_mode)
    for address in ["127.0.0.1", *public_addresses()]:
        with socket.socket() as sock:
            sock.settimeout(5)
            assert sock.connect_ex((address, server.mlflow_port)) != 0, address
    assert "the port is not used" in server.log.read_text()
    # Alice's node held its run's credential (masked in its log) and nothing the supervisors hold only.
    alice_log = (server.home / "runs" / alice_run / "attempt_0" / "node_0.log").read_text()
    assert "supervisor-only variables held: []" in alice_log, alice_log
    assert "token in full: ***" in alice_log, alice_log

    # The credential dies with its run.
    (out / "release").touch()
    server.wait_status(bob_run, "SUCCESS", timeout=300)
    status, raw = door(server, "GET", api("runs/get"), token=credential, query={"run_id": bob_node["run"]})
    assert status == 401, raw


class UnixHTTP(http.client.HTTPConnection):
    """HTTP over a Unix socket."""

    def __init__(self, path: Path) -> None:
        super().__init__("localhost", timeout=60)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(60)
        self.sock.connect(str(self.path))


def mlflow_tree(server: AirServer) -> list[psutil.Process]:
    """The MLflow server's processes (its guard, `mlflow server` and uvicorn), among the air server's."""
    assert server.proc is not None
    tree = []
    for process in psutil.Process(server.proc.pid).children(recursive=True):
        try:  # a run's process that has just ended (a zombie until reaped, or gone) is not MLflow's
            command = " ".join(process.cmdline())
        except psutil.Error:
            continue
        if "mlflow" in command and "air.runs.supervisor" not in command:
            tree.append(process)
    assert any("--socket" in p.cmdline() and "air.server.mlflow_app" in p.cmdline() for p in tree), [
        p.cmdline() for p in tree]  # MLflow on a Unix socket of its own
    return tree


def public_addresses() -> list[str]:
    """This machine's IPv4 addresses other than loopback."""
    return [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
            if a.family == socket.AF_INET and not a.address.startswith("127.")]


def test_the_doors_overhead_on_log_metric(private_mlflow_server: AirServer, tmp_path: Path) -> None:
    """log-metric through the door (alice's token on her run's MLflow run: the scoped path) vs straight to
    MLflow's loopback port (median of N, printed)."""
    server = private_mlflow_server
    alice = server.tokens["alice"]
    direct = server.mlflow_socket()
    air_run = submit(server, "alice", tmp_path / "alice.yaml", ALICE_NODE, "--watch")
    tracking_done(air_run, home=server.home)
    run_id = server.air_json("alice", "get", "run", air_run)["mlflow_run_id"]

    body = json.dumps({"run_id": run_id, "key": "m", "value": 1.0, "timestamp": 0, "step": 0}).encode()

    def timed(url: str, token: str | None) -> float:
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
        started = time.perf_counter()
        with urllib.request.urlopen(urllib.request.Request(url + api("runs/log-metric"), data=body,
                                                           headers=headers), timeout=60) as answer:
            assert answer.status == 200
        return time.perf_counter() - started

    def timed_socket(sock: Path, _: None) -> float:
        """Straight to MLflow's Unix socket (what only the server's account can do)."""
        started = time.perf_counter()
        connection = UnixHTTP(sock)
        try:
            connection.request("POST", "/mlflow" + api("runs/log-metric"), body=body,
                               headers={"Content-Type": "application/json"})
            assert connection.getresponse().status == 200
        finally:
            connection.close()
        return time.perf_counter() - started

    n = 60
    through, straight = [], []
    for _ in range(n):  # interleaved, so load on the machine hits both alike
        through.append(timed(server.url + "/mlflow", alice))
        straight.append(timed_socket(direct, None))
    door_ms, direct_ms = statistics.median(through) * 1000, statistics.median(straight) * 1000
    print(f"\nlog-metric median of {n}: through the door {door_ms:.2f} ms, direct on MLflow's socket "
          f"{direct_ms:.2f} ms, "
          f"overhead {door_ms - direct_ms:.2f} ms ({os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f})")
    # Alice may not write to an MLflow run no air run owns (only an admin may); bob may not write to hers.
    status, raw = door(server, "POST", api("runs/create"), token=server.tokens["root"], body={"experiment_id": "0"})
    assert status == 200, raw
    unowned = json.loads(raw)["run"]["info"]["run_id"]
    for token, target in ((alice, unowned), (server.tokens["bob"], run_id)):
        status, _ = door(server, "POST", api("runs/log-metric"), token=token,
                         body={"run_id": target, "key": "m", "value": 1.0, "timestamp": 0, "step": 0})
        assert status == 404


def test_a_public_url_that_is_not_an_address_is_refused(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "AIR_HOME": str(home)}
    env.pop("AIR_SERVER_URL", None)
    result = subprocess.run([*AIR, "server", "start", "--public-url", "ftp://air.example", "--mlflow-port", "0"],
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "--public-url 'ftp://air.example' is not an http(s) address" in result.stderr, result.stderr


def test_a_wildcard_bind_advertises_the_machines_name() -> None:
    from air.server.mlflow_server import public_url

    assert public_url("0.0.0.0", 8765, tls=True) == f"https://{socket.getfqdn()}:8765"
    assert public_url("0.0.0.0", 8765, tls=False, given="https://air.team.example/") == "https://air.team.example"


def test_mlflow_ui_through_the_door_with_the_pages_login(private_mlflow_server: AirServer, tmp_path: Path,
                                                          chromium_installed: None) -> None:
    """A browser logged in to the pages opens MLflow's UI at /mlflow and sees alice's run and metric; a
    browser without a login gets nothing of MLflow."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "web"))
    from web_helpers import headless_chromium

    server = private_mlflow_server
    run_id = submit(server, "alice", tmp_path / "alice.yaml", ALICE_NODE, "--watch")
    tracking_done(run_id, home=server.home)
    detail = server.air_json("alice", "get", "run", run_id)
    link = detail["mlflow_url"]
    assert link.startswith(server.url + "/mlflow/#/experiments/"), link
    with headless_chromium() as browser:
        browser.get(server.url + "/mlflow/")
        assert "UNAUTHENTICATED" in browser.page_source
        browser.get(server.url + "/ui/login")
        browser.find_element("id", "token").send_keys(server.tokens["alice"])
        browser.find_element("id", "login-button").click()
        wait_for(lambda: "/login" not in browser.current_url, "the login", timeout=60)
        browser.get(link)
        try:
            wait_for(lambda: "node_loss" in browser.page_source, "alice's metric in MLflow's UI", timeout=120,
                     interval=0.5)
        finally:
            (tmp_path / "mlflow-ui.html").write_text(browser.page_source)
        session = browser.get_cookie("air_session")
    assert session is not None
    # The session cookie reads; a cross-site (or Origin-less) write with it is refused.
    mlflow_run = detail["mlflow_run_id"]
    cookie = {"Cookie": f"air_session={session['value']}", "Content-Type": "application/json"}
    reads = urllib.request.Request(f"{server.url}/mlflow{api('runs/get')}?run_id={mlflow_run}", headers=cookie)
    with urllib.request.urlopen(reads, timeout=60) as answer:  # the test's own server
        assert json.loads(answer.read())["run"]["info"]["run_id"] == mlflow_run
    body = json.dumps({"run_id": mlflow_run, "key": "forged", "value": 1.0, "timestamp": 0, "step": 0}).encode()
    for origin in ({}, {"Origin": "https://evil.example"}):
        forged = urllib.request.Request(f"{server.url}/mlflow{api('runs/log-metric')}", data=body,
                                        headers={**cookie, **origin})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(forged, timeout=60)
        assert refused.value.code == 403


def test_graphql_is_scoped_to_the_runs_it_names() -> None:
    from air.server.mlflow_graphql import GraphQLRefused, graphql_runs, mlflow_schema

    schema = mlflow_schema()

    def runs(query: str, variables: dict[str, Any] | None = None) -> list[str] | int:
        try:
            return graphql_runs(schema, {"query": query, "variables": variables or {}})
        except GraphQLRefused as refused:
            return refused.status

    get_run = "query MlflowGetRun($data: MlflowGetRunInput!) { mlflowGetRun(input: $data) { run { info { runUuid } } } }"
    assert runs(get_run, {"data": {"runId": "r1"}}) == ["r1"]
    literal = 'query { mlflowGetRun(input: {runId: "r2"}) { run { info { runUuid } } } __typename }'
    assert runs(literal) == ["r2"]
    # A search, a mutation, a run named in no way, a root fragment reaching a search: not scoped (refused);
    # garbage does not parse (400).
    for query, status in (
            ('query { mlflowSearchRuns(input: {experimentIds: ["0"]}) { runs { info { runUuid } } } }', 403),
            ('mutation { testMutation(inputString: "x") { output } }', 403),
            ("query { mlflowGetRun(input: {}) { run { info { runUuid } } } }", 400),
            ("query { ...F } fragment F on Query { mlflowSearchRuns { runs { info { runUuid } } } }", 403),
            ("query { mlflowGetRun(input: {runId: ", 400)):
        assert runs(query) == status, query


def test_the_door_is_behind_the_servers_tls(tmp_path: Path) -> None:
    """Under --tls-*, MLflow is served over HTTPS at the server's port: a node (trusting the certificate)
    logs through it; plain HTTP gets nothing; any Host name the server is reached by passes MLflow's check."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    made = subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                           "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key),
                           "-out", str(cert)], capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    with running_server(tmp_path, mlflow=True, tls=(cert, key)) as server:
        body = f"env_variables: {{REQUESTS_CA_BUNDLE: {str(cert)!r}}}\n" + ALICE_NODE
        run_id = submit(server, "alice", tmp_path / "alice.yaml", body, "--watch")
        assert server.run_status(run_id) == "SUCCESS"
        node_log = (server.home / "runs" / run_id / "attempt_0" / "node_0.log").read_text()
        assert f"door: {server.url}/mlflow airrun_" in node_log, node_log
        assert "supervisor-only variables held: []" in node_log, node_log  # (its supervisor held the cert path)
        tracking_done(run_id, home=server.home)
        mlflow_run = server.air_json("alice", "get", "run", run_id)["mlflow_run_id"]
        status, raw = door(server, "GET", api("metrics/get-history"), token=server.tokens["alice"],
                           query={"run_id": mlflow_run, "metric_key": "node_loss"})
        assert status == 200 and [m["value"] for m in json.loads(raw)["metrics"]] == [0.25], raw
        plain = f"http://127.0.0.1:{server.port}/mlflow/api/2.0/mlflow/runs/get?run_id={mlflow_run}"
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            urllib.request.urlopen(plain, timeout=30)  # the test's own loopback server
        request = urllib.request.Request(server.url + "/mlflow/api/2.0/mlflow/experiments/search?max_results=5",
                                         headers={"Authorization": f"Bearer {server.tokens['alice']}",
                                                  "Host": "air.team.example"})
        context = ssl.create_default_context(cafile=str(cert))
        with urllib.request.urlopen(request, timeout=60, context=context) as answer:
            assert answer.status == 200 and "experiments" in json.loads(answer.read())


CALL = """
import json, os
import mlflow
from air import distributed

@distributed(num_accelerators=1, accelerator_type="CPU_1xCPU", remote=True)
def train():
    mlflow.log_metric("rank_loss", 0.125)
    return [os.environ["MLFLOW_TRACKING_URI"], os.environ["MLFLOW_TRACKING_TOKEN"][:7]]

print("RESULT " + json.dumps(train.distributed()))
"""


def test_a_remote_calls_ranks_log_through_the_door(mlflow_server: AirServer, tmp_path: Path) -> None:
    server = mlflow_server
    script = tmp_path / "call.py"
    script.write_text(CALL)
    done = subprocess.run([sys.executable, str(script)], env=server.env("alice"), cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")).removeprefix("RESULT "))
    assert result == [[server.url + "/mlflow", "airrun_"]], result
    call = server.air_json("alice", "list", "runs", "--all-status")["runs"][0]
    mlflow_run = server.air_json("alice", "get", "run", call["id"])["mlflow_run_id"]
    status, raw = door(server, "GET", api("runs/get"), token=server.tokens["alice"], query={"run_id": mlflow_run})
    assert status == 200, raw
    run = json.loads(raw)["run"]
    assert {m["key"]: m["value"] for m in run["data"]["metrics"]}.get("rank_loss") == 0.125, run["data"]
    assert {t["key"]: t["value"] for t in run["data"]["tags"]}["mlflow.user"] == "alice"


def test_supervisors_trust_the_certificate_or_skip_checks_and_nodes_get_neither(tmp_path: Path) -> None:
    """The server's supervisors reach the door at its local address with the server's credential: a
    certificate that verifies for that address is trusted as is, else (it names another host) they alone
    skip TLS checks; a node's environment keeps none of it (air.settings.node_environ)."""
    from air.server.mlflow_server import SERVER_CREDENTIAL_PREFIX, cert_verifies, supervisor_env
    from air.settings import node_environ

    pairs = {}
    for name, san in (("ip", "IP:127.0.0.1"), ("dns", "DNS:air.team.example")):
        cert, key = tmp_path / f"{name}.pem", tmp_path / f"{name}.key"
        made = subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                               "/CN=air", "-addext", f"subjectAltName={san}", "-keyout", str(key), "-out", str(cert)],
                              capture_output=True, text=True, timeout=60)
        assert made.returncode == 0, made.stderr
        pairs[name] = (cert, key)
    assert cert_verifies(*pairs["ip"], "127.0.0.1") and not cert_verifies(*pairs["dns"], "127.0.0.1")
    assert cert_verifies(*pairs["dns"], "air.team.example")
    secret = SERVER_CREDENTIAL_PREFIX + "x" * 43
    trusted = supervisor_env("0.0.0.0", 8765, credential=secret, tls_cert=pairs["ip"][0], tls_key=pairs["ip"][1])
    assert trusted["MLFLOW_TRACKING_URI"] == "https://127.0.0.1:8765/mlflow"
    assert trusted["MLFLOW_TRACKING_SERVER_CERT_PATH"] == str(pairs["ip"][0].resolve())
    assert "MLFLOW_TRACKING_INSECURE_TLS" not in trusted
    insecure = supervisor_env("127.0.0.1", 8765, credential=secret, tls_cert=pairs["dns"][0], tls_key=pairs["dns"][1])
    assert insecure["MLFLOW_TRACKING_INSECURE_TLS"] == "true" and "MLFLOW_TRACKING_SERVER_CERT_PATH" not in insecure
    plain = supervisor_env("10.0.0.7", 8765, credential=secret)
    assert plain == {"MLFLOW_TRACKING_URI": "http://10.0.0.7:8765/mlflow", "MLFLOW_TRACKING_TOKEN": secret,
                     "AIR_SUPERVISOR_ONLY": "MLFLOW_TRACKING_URI,MLFLOW_TRACKING_TOKEN"}
    for given in (trusted, insecure):
        node = node_environ({"PATH": "/usr/bin", **given})
        assert node == {"PATH": "/usr/bin"}, node
    # without a server, a user's own MLflow settings reach their nodes as before
    assert node_environ({"MLFLOW_TRACKING_INSECURE_TLS": "true"}) == {"MLFLOW_TRACKING_INSECURE_TLS": "true"}


def test_the_server_credential_is_private_and_stable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Kept 0600 beside the server's state and the same after a restart (supervisors outlive the server)."""
    from air.server.mlflow_server import SERVER_CREDENTIAL_PREFIX, server_credential

    monkeypatch.setenv("AIR_HOME", str(tmp_path / "home"))
    first = server_credential()
    path = tmp_path / "home" / "server" / "mlflow-credential"
    assert first.startswith(SERVER_CREDENTIAL_PREFIX) and path.read_text().strip() == first
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert server_credential() == first
