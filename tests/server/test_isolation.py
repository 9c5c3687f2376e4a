"""Walls between users (issue 22): a run of `air server` never runs as the server's account.

Through the real CLI against a real server on loopback, run as root, with plain tokens for alice and bob:
bob's workload tries to read alice's secrets, the server's store and session key and alice's run's log,
and to make himself an admin by writing runs.db; every attempt is denied, and bob's run still trains
(its checkpoint, its secret, an MLflow metric). Also: a server that cannot isolate refuses two users
unless told `--single-trust-domain`, and canceling an isolated run leaves no process behind.
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from server_helpers import AIR, AirServer, free_port, running_server

from proc_helpers import wait_for

ATTACK = r'''
import json, os, pwd, subprocess, sys

home = os.environ["SERVER_HOME"]
targets = {
    "alice_secrets": f"{home}/server/users/alice/secrets.json",
    "runs_db": f"{home}/runs.db",
    "session_key": f"{home}/server/session-secret",
    "alice_log": f"{home}/runs/{os.environ['ALICE_RUN']}/attempt_0/node_0.log",
}
for name, path in targets.items():
    try:
        with open(path, "rb") as fh:
            got = "READ %d bytes" % len(fh.read())
    except OSError as exc:
        got = type(exc).__name__
    print("ATTEMPT " + json.dumps({"what": name, "got": got}), flush=True)
write = subprocess.run(["/usr/bin/python3", "-c",
                        "import sqlite3, sys; c = sqlite3.connect(sys.argv[1]); "
                        "c.execute('UPDATE api_tokens SET admin=1'); c.commit(); print('WROTE')",
                        f"{home}/runs.db"], capture_output=True, text=True)
got = "WROTE" if "WROTE" in write.stdout else (write.stderr.strip().splitlines() or ["?"])[-1]
print("ATTEMPT " + json.dumps({"what": "write_runs_db", "got": got}), flush=True)
print("WHO " + json.dumps({"uid": os.getuid(), "user": pwd.getpwuid(os.getuid()).pw_name,
                          "home_holds": sorted(os.listdir(home)) if os.path.isdir(home) else []}), flush=True)

ckpt = os.path.join(os.environ["AIR_CHECKPOINT_DIR"], "step_1.txt")
with open(ckpt, "w") as fh:
    fh.write("weights")
print("CHECKPOINT " + ckpt, flush=True)
print("SECRET " + ("ok" if os.environ.get("BOB_KEY") == os.environ["EXPECTED_KEY_REVERSED"][::-1] else "wrong"),
      flush=True)
import socket, urllib.request
try:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(os.environ["MLFLOW_SOCKET"])
    got = "CONNECTED"
except OSError as exc:
    got = type(exc).__name__
print("ATTEMPT " + json.dumps({"what": "mlflow_socket", "got": got}), flush=True)
answered = []
for port in [int(p) for p in os.environ["SWEEP_PORTS"].split(",") if p]:
    for path in ("/mlflow/api/2.0/mlflow/experiments/search?max_results=1",
                 "/api/2.0/mlflow/experiments/search?max_results=1"):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
                if answer.status == 200 and b"experiments" in answer.read():
                    answered.append(port)
        except Exception:
            pass
print("SWEEP " + json.dumps({"ports": os.environ["SWEEP_PORTS"], "answered": answered}), flush=True)
try:
    import mlflow
    mlflow.log_metric("loss", 0.25)
    print("MLFLOW ok", flush=True)
except Exception as exc:
    print("MLFLOW failed: %s: %s" % (type(exc).__name__, str(exc)[:300]), flush=True)
'''

BOB_SECRET = "bob-key-0123456789"


@pytest.fixture
def isolated(tmp_path: Path) -> Iterator[AirServer]:
    """A server as root with isolation on (its default) and its MLflow behind the server."""
    with running_server(tmp_path, mlflow=True, start_args=()) as srv:
        yield srv


def _spec(folder: Path, name: str, body: str, command: str, extra: str = "") -> Path:
    code = folder / "code"
    code.mkdir(parents=True)
    (code / "main.py").write_text(body)
    spec = folder / "wl.yaml"
    spec.write_text(textwrap.dedent(f"""
        experiment_name: {name}
        compute: {{accelerator_type: CPU_1xCPU, num_accelerators: 1}}
        code_source: {{snapshot: {{root_path: code}}}}
        command: {command}
    """) + extra)
    return spec


def _alice_long_run(server: AirServer, tmp_path: Path) -> str:
    put = subprocess.run([*AIR, "secrets", "put", "keys", "alice"], env=server.env("alice"),
                         input="alice-very-secret", capture_output=True, text=True, timeout=60)
    assert put.returncode == 0, put.stderr
    spec = _spec(tmp_path / "alice", "alice-exp", textwrap.dedent("""
        import time
        print("alice started", flush=True)
        for i in range(600):
            time.sleep(0.5)
    """), "python $CODE_SOURCE_PATH/main.py")
    run_id = str(server.air_json("alice", "run", "-f", str(spec))["run_id"])
    server.wait_status(run_id, "RUNNING")
    log = server.home / "runs" / run_id / "attempt_0" / "node_0.log"
    wait_for(lambda: log.exists() and "alice started" in log.read_text(), "alice's node to start", timeout=120)
    return run_id


def _run_processes(run_id: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("AIR_RUN_ID") == run_id and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


def _listening(server: AirServer, *, mlflow_only: bool = False) -> list[Any]:
    """The TCP sockets the air server's processes (or only its MLflow server's) listen on."""
    assert server.proc is not None
    found = []
    for proc in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            if mlflow_only and "mlflow" not in " ".join(proc.cmdline()):
                continue
            found += [c for c in proc.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


def test_bobs_run_cannot_reach_alice_or_the_server_and_still_trains(isolated: AirServer, tmp_path: Path) -> None:
    server = isolated
    health = server.api("GET", "/api/v1/health")[1]
    assert health["isolation"] == "unix-user+bwrap", health
    alice_run = _alice_long_run(server, tmp_path)
    alice_log = server.home / "runs" / alice_run / "attempt_0" / "node_0.log"
    before = alice_log.read_text()
    # Alice's node runs as her own account, not the server's.
    users = {p.username() for p in _run_processes(alice_run)}
    assert server.account("alice") in users and users <= {server.account("alice"), "root"}, users
    assert not any(p.username() == "root" and "main.py" in " ".join(p.cmdline()) for p in _run_processes(alice_run))

    put = subprocess.run([*AIR, "secrets", "put", "keys", "bob"], env=server.env("bob"), input=BOB_SECRET,
                         capture_output=True, text=True, timeout=60)
    assert put.returncode == 0, put.stderr
    # Every port a process of the server listens on (its MLflow's, its supervisors', alice's run's), the
    # server's own excepted, and the port MLflow once listened on: bob sweeps them for an MLflow without a token.
    sweep = sorted({c.laddr.port for c in _listening(server)} - {server.port} | {server.mlflow_port})
    mlflow_socket = server.mlflow_socket()
    extra = textwrap.dedent(f"""
        secrets: {{BOB_KEY: keys/bob}}
        env_variables:
          SERVER_HOME: {server.home}
          ALICE_RUN: {alice_run}
          EXPECTED_KEY_REVERSED: {BOB_SECRET[::-1]}
          MLFLOW_SOCKET: {mlflow_socket}
          SWEEP_PORTS: "{",".join(map(str, sweep))}"
    """)
    spec = _spec(tmp_path / "bob", "bob-exp", ATTACK, "python $CODE_SOURCE_PATH/main.py", extra)
    bob_run = str(server.air_json("bob", "run", "-f", str(spec))["run_id"])
    assert server.wait_status(bob_run, "SUCCESS", "FAILED", "INTERNAL_ERROR", timeout=240) == "SUCCESS", \
        (server.home / "runs" / bob_run / "attempt_0" / "node_0.log").read_text()
    lines = (server.home / "runs" / bob_run / "attempt_0" / "node_0.log").read_text().splitlines()
    print("\n".join(lines))  # what each attempt got, for the reader of the test's output
    attempts = {d["what"]: d["got"] for d in (json.loads(ln.split("ATTEMPT ", 1)[1]) for ln in lines if "ATTEMPT " in ln)}
    assert set(attempts) == {"alice_secrets", "runs_db", "session_key", "alice_log", "write_runs_db",
                             "mlflow_socket"}, attempts
    # (not in bob's view at all; and were it there, the 0700 folder stops bob's account, as seen below)
    assert attempts["mlflow_socket"] in ("PermissionError", "FileNotFoundError"), attempts
    knock = subprocess.run(["runuser", "-u", server.account("bob"), "--", "/usr/bin/python3", "-c",
                            "import socket, sys; s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])",
                            str(mlflow_socket)],
                           capture_output=True, text=True, timeout=60)
    assert knock.returncode != 0 and "PermissionError" in knock.stderr, knock.stderr
    swept = json.loads(next(ln.split("SWEEP ", 1)[1] for ln in lines if "SWEEP " in ln))
    assert swept["answered"] == [], swept
    # MLflow itself listens on no TCP port; its socket's folder is the server's (root's) alone
    assert mlflow_socket.exists()
    folder = os.stat(mlflow_socket.parent)
    assert folder.st_mode & 0o777 == 0o700 and folder.st_uid == 0, oct(folder.st_mode)
    assert not [c for c in _listening(server, mlflow_only=True)], _listening(server, mlflow_only=True)
    for what, got in attempts.items():
        assert not got.startswith(("READ", "WROTE")), f"{what}: {got}"
    # The targets that exist on the server really are there: the walls, not a wrong path, stopped bob.
    assert (server.home / "server/users/alice/secrets.json").exists() and (server.home / "runs.db").exists()
    assert alice_log.exists()
    who = json.loads(next(ln.split("WHO ", 1)[1] for ln in lines if "WHO " in ln))
    assert who["user"] == server.account("bob") and who["uid"] == pwd.getpwnam(server.account("bob")).pw_uid, who
    # of the server's home the view holds only the empty folders on the way to bob's own code and checkpoints
    assert "runs.db" not in who["home_holds"] and "users" not in who["home_holds"], who

    # bob is still no admin, and may still not touch alice's run
    status, body = server.api("GET", "/api/v1/whoami", token=server.tokens["bob"])
    assert status == 200 and body["admin"] is False, body
    assert server.run_status(alice_run) == "RUNNING"
    assert alice_log.read_text().startswith(before)

    # bob's run trained: checkpoint written (as his account, in his run's checkpoint folder), secret read,
    # MLflow metric logged through the server
    checkpoint = next(ln.split("CHECKPOINT ", 1)[1] for ln in lines if "CHECKPOINT " in ln)
    assert Path(checkpoint).read_text() == "weights"
    assert Path(checkpoint).owner() == server.account("bob")
    assert any(ln.endswith("SECRET ok") for ln in lines), lines
    assert any(ln.endswith("MLFLOW ok") for ln in lines), [ln for ln in lines if "MLFLOW" in ln]

    # the server's state is its own: 0700 home, 0600 store
    assert os.stat(server.home).st_mode & 0o777 == 0o700
    assert os.stat(server.home / "runs.db").st_mode & 0o777 == 0o600

    # tearing down alice's isolated run (cancel) leaves none of its processes
    cancel = server.air("root", "cancel", alice_run)
    assert cancel.returncode == 0, cancel.stderr
    server.wait_status(alice_run, "CANCELED")
    wait_for(lambda: not _run_processes(alice_run), f"every process of {alice_run} to end", timeout=60)


def test_a_server_that_cannot_isolate_refuses_two_users_unless_told(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("AIR_SERVER_URL", "AIR_TOKEN")}
    env.update({"AIR_HOME": str(home), "AIR_ISOLATION_UNAVAILABLE": "1", "AIR_CPU_SLOTS": "4"})
    for user in ("alice", "bob"):
        made = subprocess.run([*AIR, "server", "token", "create", user], env=env, capture_output=True, text=True,
                              timeout=60)
        assert made.returncode == 0, made.stderr
    port = str(free_port())
    refused = subprocess.run([*AIR, "server", "start", "--port", port, "--mlflow-port", "0"], env=env,
                             capture_output=True, text=True, timeout=120)
    print(refused.stderr)
    assert refused.returncode == 2, refused.stderr
    assert "cannot wall runs off" in refused.stderr and "--single-trust-domain" in refused.stderr
    assert "alice, bob" in refused.stderr

    (tmp_path / "trusted").mkdir()
    with running_server(tmp_path / "trusted", start_args=("--single-trust-domain",)) as server:
        assert server.api("GET", "/api/v1/health")[1]["isolation"] == "none (single trust domain)"


def test_unix_user_must_name_an_account_that_is_not_root(tmp_path: Path) -> None:
    env = {**os.environ, "AIR_HOME": str(tmp_path / "home")}
    for account, says in (("root", "is root"), ("no-such-account-x", "no Unix account")):
        made = subprocess.run([*AIR, "server", "token", "create", "carol", "--unix-user", account], env=env,
                              capture_output=True, text=True, timeout=60)
        assert made.returncode == 2 and says in made.stderr, made.stderr
    listed = subprocess.run([*AIR, "server", "token", "list", "--json"], env=env, capture_output=True, text=True,
                            timeout=60)
    assert json.loads(listed.stdout)["data"]["tokens"] == []  # nothing half-written
