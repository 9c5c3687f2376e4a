"""A run whose nodes wait for its MLflow run says so as its state (issue 35): Slurm's nodes get MLFLOW_RUN_ID
in their environment, so they start once the attempt's MLflow run exists. With the tracking server away,
`air list runs`, `air get run` and the run's page say what the nodes wait for; once a real MLflow server
(`air ui`) answers on that address, the run is made, the nodes start with its id, and the run ends SUCCESS with
nothing left waiting."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
from slurm_cluster import SlurmCluster

from air.errors import LaunchError
from air.store.paths import RunPaths
from proc_helpers import wait_for

pytestmark = pytest.mark.timeout(600)


def air(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "air.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class TrackingAddress:
    """The tracking server's address, held by the test from start to end (no other test's process can take
    its port meanwhile): it closes every connection at once (a server that is away) until `forward_to(port)`,
    then pipes each new one to that port (the real MLflow server, wherever it could listen)."""

    def __init__(self) -> None:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = int(self.listener.getsockname()[1])
        self.target: int | None = None
        threading.Thread(target=self._serve, daemon=True).start()

    def forward_to(self, port: int) -> None:
        self.target = port

    def close(self) -> None:
        self.listener.close()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            if self.target is None:
                conn.close()
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target), timeout=30)
            except OSError:
                conn.close()
                continue
            for source, sink in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=_pipe, args=(source, sink), daemon=True).start()


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


def _answers(port: int) -> bool:
    with contextlib.suppress(OSError), urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
        return True
    return False


def start_ui(tmp_path: Path, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], int]:
    """A real `air ui` on a free port (another one if that port was taken before it listened)."""
    for attempt in range(5):
        port = free_port()
        log = tmp_path / f"ui-{attempt}.log"
        with open(log, "wb") as out:
            ui = subprocess.Popen([sys.executable, "-m", "air.cli.main", "ui", "--port", str(port)], env=env,
                                  stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

        wait_for(lambda ui=ui, port=port: ui.poll() is not None or _answers(port), "air ui to answer or end",
                 timeout=240, interval=0.5)
        if ui.poll() is None:
            return ui, port
        assert "is busy" in log.read_text(), log.read_text()
    raise AssertionError("no free port for air ui in 5 tries")


def test_nodes_waiting_for_their_mlflow_run_is_the_runs_visible_state(hpc: SlurmCluster, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    address = TrackingAddress()
    monkeypatch.setenv("AIR_TRACKING", "on")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{address.port}")
    spec = tmp_path / "w.yaml"
    spec.write_text("experiment_name: waits\nmax_retries: 0\ncompute: {num_accelerators: 2, accelerator_type: CPU_1xCPU}\n"
                    'command: |\n  echo "run id: $MLFLOW_RUN_ID"\n')
    submitted = air("run", "-f", str(spec), "--json")
    assert submitted.returncode == 0, submitted.stderr
    run_id = str(json.loads(submitted.stdout)["data"]["run_id"])

    def listed() -> str:
        return air("list", "runs").stdout

    wait_for(lambda: "its nodes wait for its MLflow run" in listed(), "the wait in air list runs", timeout=240,
             interval=0.5)
    detail = json.loads(air("get", "run", run_id, "--json").stdout)["data"]
    assert detail["status"] == "RUNNING" and detail["waiting"].startswith("its MLflow run (http://127.0.0.1:"), detail
    assert "Waiting" in air("get", "run", run_id).stdout
    assert not RunPaths(run_id).node_log(0, 0).exists() or "run id" not in RunPaths(run_id).node_log(0, 0).read_text()

    from air.web import create_web_app
    from air.web.serve import PageServer

    for _ in range(5):  # the run's page, as `air ui` serves it (another port if this one was taken meanwhile)
        pages_port = free_port()
        pages = PageServer(create_web_app(), "127.0.0.1", pages_port)
        with contextlib.suppress(LaunchError):
            pages.start()
            break
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{pages_port}/runs/{run_id}", timeout=60) as answer:
            shown = answer.read().decode()
    finally:
        pages.stop()
    assert 'id="run-waiting"' in shown and "Its nodes wait for its MLflow run" in shown, shown[-3000:]

    # A real MLflow server (`air ui`) comes up behind the address: the run is made, the nodes start with its id
    ui_env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}  # (it serves this AIR_HOME's store)
    ui, ui_port = start_ui(tmp_path, ui_env)
    address.forward_to(ui_port)
    try:
        def ended() -> bool:
            got = json.loads(air("get", "run", run_id, "--json").stdout)["data"]
            return got["status"] not in ("QUEUED", "RUNNING")

        wait_for(ended, "the run to end once MLflow answers", timeout=300, interval=1.0)
        detail = json.loads(air("get", "run", run_id, "--json").stdout)["data"]
        assert detail["status"] == "SUCCESS", detail
        assert detail["waiting"] is None and not RunPaths(run_id).waiting.exists()
        for node in (0, 1):
            line = RunPaths(run_id).node_log(0, node).read_text()
            assert "run id: " in line and line.split("run id: ", 1)[1].strip(), line  # started with its id
        assert "its nodes wait" not in listed()
    finally:
        ui.send_signal(signal.SIGINT)
        ui.wait(timeout=60)
        address.close()
