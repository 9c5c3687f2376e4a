"""`air server start` says it is starting at once, serves its API and pages while MLflow starts beside it
(the door answers 503 "MLflow is starting", GET /api/v1/health says `starting`), says when MLflow is
ready, and keeps MLflow's and Starlette's noise in its log (server/server.log), not the terminal. A run
submitted while MLflow starts still lands its metric there. AIR_MLFLOW_HOLD holds MLflow `starting` until
a file exists, so the order is certain on any machine, however loaded."""

from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from server_helpers import AIR, AirServer, alive, free_port, home_processes, wait_for

from air.settings import AIR_MLFLOW_HOLD
from proc_helpers import tracking_done


class Terminal:
    """The server's stdout+stderr, line by line, each with the seconds since the process started."""

    def __init__(self, proc: subprocess.Popen[str], started: float) -> None:
        self.lines: list[tuple[float, str]] = []
        self._proc = proc
        self._started = started
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            self.lines.append((time.monotonic() - self._started, line.rstrip("\n")))

    def has(self, text: str) -> bool:
        return any(text in line for _, line in self.lines)

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def close(self) -> None:
        self._thread.join(timeout=30)


def _get(url: str, token: str | None = None) -> tuple[int, Any]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def _start(srv: AirServer, env: dict[str, str]) -> tuple[subprocess.Popen[str], Terminal]:
    started = time.monotonic()
    proc = subprocess.Popen([*AIR, "server", "start", "--port", str(srv.port), "--single-trust-domain"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return proc, Terminal(proc, started)


def _health(srv: AirServer) -> dict[str, Any] | None:
    try:
        return _get(srv.url + "/api/v1/health")[1]
    except OSError:
        return None


def _stop(srv: AirServer, proc: subprocess.Popen[str], terminal: Terminal) -> None:
    proc.terminate()
    assert proc.wait(timeout=60) == 0, terminal.text()
    terminal.close()
    wait_for(lambda: not alive(home_processes(srv.home)), "every process of the server's home to end", timeout=60)


def _server(tmp_path: Path) -> AirServer:
    srv = AirServer(home=tmp_path / "server-home", port=free_port(), clients=tmp_path / "clients",
                    log=tmp_path / "unused.log")
    srv.home.mkdir()
    srv.tokens = {"alice": srv.token_create("alice"), "root": srv.token_create("root", "--admin")}
    return srv


def test_the_server_says_it_starts_at_once_and_serves_before_mlflow(tmp_path: Path) -> None:
    srv = _server(tmp_path)
    hold = tmp_path / "mlflow-may-be-ready"
    proc, terminal = _start(srv, {**srv.server_env(), AIR_MLFLOW_HOLD: str(hold)})
    try:
        wait_for(lambda: terminal.lines, "the server's first line", timeout=60)
        first_at, first = terminal.lines[0]
        print(f"first line after {first_at:.2f} s; ", end="")
        assert first.startswith(f"air server: starting on {srv.url}") and "MLflow starts beside it" in first, first
        # Printed before FastAPI or MLflow is imported: a bound that holds however loaded the machine is.
        assert first_at < 15, first_at

        health = wait_for(lambda: _health(srv), "the API to answer", timeout=240)
        assert isinstance(health, dict)
        answered_at = time.monotonic() - terminal._started
        print(f"health after {answered_at:.1f} s", end="")
        assert health["status"] == "ok" and health["mlflow"]["state"] == "starting", health
        status, body = _get(srv.url + "/mlflow/api/2.0/mlflow/experiments/search?max_results=5", srv.tokens["root"])
        assert status == 503 and body["error_code"] == "TEMPORARILY_UNAVAILABLE", (status, body)
        assert "MLflow is starting" in body["message"], body
        with urllib.request.urlopen(srv.url + "/ui/login", timeout=30) as page:  # the pages answer too
            assert page.status == 200 and b"<html" in page.read()
        wait_for(lambda: terminal.has("  Runs:"), "the server's banner", timeout=60)
        assert terminal.has("MLflow: " + srv.url + "/mlflow; starting"), terminal.text()

        # A run submitted while MLflow starts: its supervisor waits for MLflow, and the metric lands.
        spec = tmp_path / "wl.yaml"
        spec.write_text("experiment_name: early\ncompute: {accelerator_type: CPU_1xCPU, num_accelerators: 1}\n"
                        "command: python -c \"import mlflow; mlflow.log_metric('early_loss', 0.5)\"\n")
        submitted = srv.air("alice", "run", "-f", str(spec))
        assert submitted.returncode == 0, submitted.stdout + submitted.stderr
        assert _health(srv)["mlflow"]["state"] == "starting"  # type: ignore[index]

        hold.touch()
        wait_for(lambda: (_health(srv) or {}).get("mlflow", {}).get("state") == "ready", "MLflow to be ready",
                 timeout=300, interval=0.5)
        wait_for(lambda: terminal.has("air server: MLflow ready ("), "the ready line", timeout=30)
        status, body = _get(srv.url + "/mlflow/api/2.0/mlflow/experiments/search?max_results=5", srv.tokens["root"])
        assert status == 200, (status, body)

        run_id = srv.air_json("alice", "list", "runs", "--all-status")["runs"][0]["id"]
        srv.wait_status(run_id, "SUCCESS", "FAILED", "CANCELED", timeout=300)
        tracking_done(run_id, home=srv.home)  # (an ended run's MLflow id is recorded just after its end)
        detail = srv.air_json("alice", "get", "run", run_id)
        assert detail["status"] == "SUCCESS", detail
        status, body = _get(srv.url + f"/mlflow/api/2.0/mlflow/runs/get?run_id={detail['mlflow_run_id']}",
                            srv.tokens["alice"])
        assert status == 200, body
        metrics = {m["key"]: m["value"] for m in body["run"]["data"].get("metrics", [])}
        assert metrics.get("early_loss") == 0.5, body
    finally:
        _stop(srv, proc, terminal)

    # The terminal holds air's lines only; MLflow's and Starlette's went to the server's log.
    noise = [line for _, line in terminal.lines if not (line.startswith("air server") or line.startswith("  "))]
    assert not noise, terminal.text()
    for word in ("INFO", "Uvicorn", "Starlette", "Warning", "mlflow.server"):
        assert not terminal.has(word), terminal.text()
    log = srv.home / "server" / "server.log"
    assert "Uvicorn running on unix socket" in log.read_text()
    assert terminal.has(f"its output: {log}")


def test_an_mlflow_that_cannot_start_is_said_and_the_api_keeps_serving(tmp_path: Path) -> None:
    srv = _server(tmp_path)
    (srv.home / "mlartifacts").write_text("")  # not a folder: MLflow's artifacts have nowhere to go
    proc, terminal = _start(srv, srv.server_env())
    try:
        wait_for(lambda: _health(srv), "the API to answer", timeout=240)
        wait_for(lambda: terminal.has("MLflow is NOT running"), "the server to say MLflow failed", timeout=300,
                 interval=0.2)
        line = next(line for _, line in terminal.lines if "MLflow is NOT running" in line)
        assert str(srv.home / "server" / "server.log") in line and "--no-mlflow" in line, line
        health = _health(srv)
        assert health is not None and health["mlflow"]["state"] == "failed" and health["mlflow"]["message"], health
        status, body = _get(srv.url + "/mlflow/api/2.0/mlflow/experiments/search?max_results=5", srv.tokens["root"])
        assert status == 503 and "not running" in body["message"], body
        status, body = _get(srv.url + "/api/v1/runs", srv.tokens["alice"])
        assert status == 200, body
    finally:
        _stop(srv, proc, terminal)


def test_a_busy_port_names_air_server_starts_own_flag(tmp_path: Path) -> None:
    """`air server start` on a port another program holds: exit 1, the port is busy, and the hint is
    `air server start --port N` (not `air ui`'s), before anything is started."""
    import os
    import socket

    home = tmp_path / "server-home"
    home.mkdir()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = subprocess.run([*AIR, "server", "start", "--port", str(port), "--single-trust-domain"],
                                capture_output=True, text=True, timeout=120,
                                env={**os.environ, "AIR_HOME": str(home)})
    assert result.returncode == 1, result.stderr
    assert f"Port {port} on 127.0.0.1 is busy: another program listens there." in result.stderr
    assert "e.g. `air server start --port " in result.stderr and "air ui" not in result.stderr, result.stderr
    assert not alive(home_processes(home))
