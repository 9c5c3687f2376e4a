"""A real `air server` on loopback with its own AIR_HOME, two users (alice, bob) and an admin (root),
and the `air` CLI run as each of them (their own AIR_HOME, AIR_SERVER_URL + AIR_TOKEN). Used by
tests/server (its conftest's `server` fixture) and by the Ray tests that put a server before a cluster."""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from proc_helpers import alive, wait_for

AIR = [sys.executable, "-m", "air.cli.main"]
#: A server configuration whose runs only their user (and whom they grant) may see.
PRIVATE = "server:\n  default_visibility: private\n"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def home_processes(home: Path) -> list[int]:
    """Processes whose AIR_HOME is `home` (the server, supervisors, nodes) — other users' are skipped."""
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get("AIR_HOME") == str(home) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


@dataclass
class AirServer:
    home: Path
    port: int
    clients: Path
    log: Path
    tokens: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    #: The port of the MLflow server it runs (0: none, the runs log to its embedded store).
    mlflow_port: int = 0
    #: (certificate, key) to serve HTTPS with; clients trust the certificate through SSL_CERT_FILE.
    tls: tuple[Path, Path] | None = None
    #: More `air server start` arguments (e.g. --single-trust-domain).
    start_args: tuple[str, ...] = ()
    #: Whether its runs record to MLflow (None: as the test's environment says, AIR_TRACKING).
    tracking: bool | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def server_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("AIR_SERVER_URL", "AIR_TOKEN")}
        if self.tracking is not None:
            env.pop("AIR_TRACKING", None)
            if not self.tracking:
                env["AIR_TRACKING"] = "off"
        return {**env, "AIR_HOME": str(self.home), "AIR_CPU_SLOTS": "8"}

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([*AIR, "server", "start", "--port", str(self.port), "--mlflow-port",
                                          str(self.mlflow_port), *self.tls_args(), *self.start_args],
                                         env=self.server_env(),
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(self.healthy, f"air server on {self.url} to answer (log: {self.log})", timeout=240)

    def tls_context(self) -> ssl.SSLContext | None:
        """What a client of this server verifies its HTTPS with (None: plain HTTP)."""
        return ssl.create_default_context(cafile=str(self.tls[0])) if self.tls else None

    def tls_args(self) -> list[str]:
        return ["--tls-cert", str(self.tls[0]), "--tls-key", str(self.tls[1])] if self.tls else []

    def healthy(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"air server exited {self.proc.returncode}: {self.log.read_text()}")
        try:
            context = self.tls_context()
            with urllib.request.urlopen(self.url + "/api/v1/health", timeout=2, context=context) as r:
                health = json.loads(r.read())
        except OSError:
            return False
        # The API answers while MLflow starts beside it: a test of MLflow waits for it to be ready.
        mlflow = health.get("mlflow", {}).get("state", "off")
        if mlflow == "failed":
            raise AssertionError(f"the server's MLflow failed: {health} (log: {self.home / 'server' / 'server.log'})")
        return bool(health["status"] == "ok" and mlflow in ("ready", "off"))

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        code = self.proc.wait(timeout=timeout)
        self.proc = None
        return code

    def token_create(self, user: str, *extra: str) -> str:
        result = subprocess.run([*AIR, "server", "token", "create", user, *extra], env=self.server_env(),
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        return result.stdout.strip().splitlines()[-1]

    def env(self, user: str) -> dict[str, str]:
        home = self.clients / user
        env = {**os.environ, "AIR_HOME": str(home), "AIR_SERVER_URL": self.url, "AIR_TOKEN": self.tokens[user]}
        return {**env, "SSL_CERT_FILE": str(self.tls[0])} if self.tls else env

    def air(self, user: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """The real `air` CLI as `user`, through the server."""
        return subprocess.run([*AIR, *args], env=self.env(user), capture_output=True, text=True, timeout=timeout)

    def air_json(self, user: str, *args: str) -> Any:
        result = self.air(user, *args, "--json")
        assert result.returncode == 0, result.stdout + result.stderr
        return json.loads(result.stdout)["data"]

    def submit(self, user: str, spec: Path, text: str) -> str:
        """Write the workload YAML `text` at `spec` and submit it as `user` (`air run`); the run's id."""
        spec.parent.mkdir(parents=True, exist_ok=True)
        spec.write_text(text)
        return str(self.air_json(user, "run", "-f", str(spec))["run_id"])

    def logs(self, user: str, run_id: str) -> str:
        """The run's lines so far, as `user` reads them (`air logs RUN --no-follow`)."""
        result = self.air(user, "logs", run_id, "--no-follow")
        assert result.returncode == 0, result.stderr
        return result.stdout

    def log_text(self, user: str, run_id: str) -> str:
        """The current attempt's logs so far as `user` reads them through the API (`GET /runs/{id}/logs`, then
        each log): what a test polls while it waits for a line. A poll of `logs` costs an `air` process (~0.3 s
        of CPU) each time; this costs a few HTTP requests. "" while the run has no log (or `user` may not read
        it)."""
        status, listing = self.api("GET", f"/api/v1/runs/{run_id}/logs", token=self.tokens[user])
        if status != 200:
            return ""
        context = self.tls_context()
        texts = []
        for log in listing["logs"]:
            request = urllib.request.Request(
                f"{self.url}/api/v1/runs/{run_id}/logs/{log['label']}/{log['index']}?attempt={listing['attempt']}",
                headers={"Authorization": f"Bearer {self.tokens[user]}"})
            try:
                with urllib.request.urlopen(request, timeout=60, context=context) as answer:
                    texts.append(answer.read().decode(errors="replace"))
            except urllib.error.HTTPError:
                continue  # gone between the list and the read (a new attempt): the next poll sees it
        return "".join(texts)

    def api(self, method: str, path: str, *, token: str | None = None, body: Any = None,
            data: bytes | None = None) -> tuple[int, Any]:
        """One raw HTTP request: (status, decoded JSON)."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        context = self.tls_context()
        try:
            with urllib.request.urlopen(request, timeout=60, context=context) as r:
                return r.status, json.loads(r.read() or b"null")
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"null")

    def run_status(self, run_id: str) -> str:
        return str(self.api("GET", f"/api/v1/runs/{run_id}", token=self.tokens["root"])[1]["status"])

    def run_status_offline(self, run_id: str) -> str:
        """The run's status read from the server's store while no server runs."""
        from air.store.run_store import RunStore

        return RunStore(self.home / "runs.db").get_run(run_id).status.value

    def wait_status(self, run_id: str, *statuses: str, timeout: float = 120) -> str:
        return str(wait_for(lambda: (s := self.run_status(run_id)) in statuses and s,
                            f"run {run_id} to be {'/'.join(statuses)}", timeout=timeout, interval=0.2))

    def account(self, user: str) -> str:
        """The Unix account this (root, isolated) server runs `user`'s runs as, as its start-up lines say
        (`air-<server id>-<user>`: each server's own)."""
        import re

        found = re.search(r"as Unix account (\S+)NAME", self.log.read_text())
        assert found, f"no account prefix in the server's start-up lines: {self.log.read_text()}"
        return found.group(1) + user

    def mlflow_socket(self) -> Path:
        """The Unix socket the server's MLflow listens on (air.server.mlflow_app's `--socket`, or uvicorn's
        `--uds` under `mlflow server`): ServerPaths.mlflow_socket, or a 0700 temporary folder's when that
        path is longer than a socket path may be (a deep tmp_path)."""
        assert self.proc is not None
        for process in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                argv = process.cmdline()
            except psutil.Error:
                continue
            for index, arg in enumerate(argv):
                if arg.startswith("--uds "):
                    return Path(arg.split(" ", 1)[1])
                if arg == "--socket" and "air.server.mlflow_app" in argv and index + 1 < len(argv):
                    return Path(argv[index + 1])
        raise AssertionError("no MLflow process listening on a Unix socket under the server")

    def sleeping_run(self, user: str, folder: Path, name: str) -> str:
        """A RUNNING run of `user` that sleeps until canceled, once its log says it sleeps (an isolated
        run cannot signal through the test's files)."""
        spec = folder / f"{name}.yaml"
        spec.write_text(f"experiment_name: {name}\n"
                        "compute: {num_accelerators: 1, accelerator_type: CPU_1xCPU}\n"
                        "max_retries: 0\n"
                        f'command: echo "{name} sleeping"; sleep 600\n')
        run_id = str(self.air_json(user, "run", "-f", str(spec))["run_id"])
        self.wait_status(run_id, "RUNNING", timeout=180)
        wait_for(lambda: f"{name} sleeping" in self.log_text(user, run_id),
                 f"{name}'s sleep to start", timeout=60, interval=0.5)
        return run_id


@contextmanager
def running_server(tmp_path: Path, *, mlflow: bool = False, config: str | None = None,
                   tls: tuple[Path, Path] | None = None,
                   start_args: tuple[str, ...] = ("--single-trust-domain",),
                   tracking: bool | None = None) -> Iterator[AirServer]:
    """A started server (its home's config.yaml = `config`); afterwards it is stopped with SIGTERM and
    no process of its home survives. By default its runs are not walled in (`--single-trust-domain`), so a
    test's workload may wait on a file of the test; tests/server/test_isolation.py starts it isolated.
    `tracking` set: its runs record to MLflow or not whatever the environment says (a server shared by
    tests must not take it from the test that happened to start it)."""
    srv = AirServer(home=tmp_path / "server-home", port=free_port(), clients=tmp_path / "clients",
                    log=tmp_path / "server.log", mlflow_port=free_port() if mlflow else 0, tls=tls,
                    start_args=start_args, tracking=tracking)
    srv.home.mkdir()
    if config is not None:
        (srv.home / "config.yaml").write_text(config)
    srv.tokens = {"alice": srv.token_create("alice"), "bob": srv.token_create("bob"),
                  "root": srv.token_create("root", "--admin")}
    srv.start()
    try:
        yield srv
    finally:
        if srv.proc is not None:
            code = srv.stop()
            assert code == 0, f"exit code {code}: {srv.log.read_text()}"
        try:
            wait_for(lambda: not alive(home_processes(srv.home)), "every process of the server's home to end",
                     timeout=60)
        finally:  # a test that failed mid-run leaves its runs going: end them, so they load no later test
            for pid in home_processes(srv.home):
                with suppress(psutil.Error):
                    psutil.Process(pid).kill()


@contextmanager
def running_isolated_server(tmp_path: Path, **kwargs: Any) -> Iterator[AirServer]:
    """`running_server` isolated (its default `unix-user+bwrap`: runs walled in as each user's account),
    after checking the server says so."""
    with running_server(tmp_path, start_args=(), **kwargs) as srv:
        status, health = srv.api("GET", "/api/v1/health")
        assert status == 200 and health["isolation"] == "unix-user+bwrap", health
        yield srv


def wait_file(path: Path, what: str, timeout: float = 60) -> None:
    wait_for(path.exists, what, timeout=timeout)
