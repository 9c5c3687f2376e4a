"""`air ui` through the real CLI: any way it stops ends MLflow's whole server tree and frees the port; a
busy port is an error that says so; `air get run` links to the port the UI really listens on."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from proc_helpers import alive, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workload_runs"))
from runs_helpers import air, submit, wait_terminal, write_workload

#: A UI start imports MLflow in several processes: tens of seconds on a loaded 2-core machine.
READY_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


class UI:
    """A real `air ui` process, started as a user would, with its output in a file."""

    def __init__(self, tmp_path: Path, port: int, *extra: str) -> None:
        self.port = port
        self.log = tmp_path / f"ui-{port}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "air.cli.main", "ui", "--port", str(port), *extra],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_ready(self) -> list[psutil.Process]:
        """Wait until the page answers; return every process `air ui` started (its whole tree)."""

        def ready() -> bool:
            assert self.proc.poll() is None, f"air ui exited {self.proc.returncode}:\n{self.log.read_text()}"
            return answers(self.port)

        wait_for(ready, f"the UI on port {self.port}", timeout=READY_TIMEOUT_S, interval=0.5)
        return [p for p in psutil.Process(self.proc.pid).children(recursive=True) if _running(p)]

    def kill_all(self) -> None:
        """Cleanup for a failed test only: whatever is left of the tree."""
        try:
            procs = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.Error:
            procs = []
        for proc in procs:
            try:
                proc.kill()
            except psutil.Error:
                pass
        self.proc.wait(timeout=30)


def _running(proc: psutil.Process) -> bool:
    """Not ended (a zombie, such as a helper a server started and has not reaped yet, runs nothing)."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@pytest.fixture
def started(tmp_path: Path) -> Iterator[list[UI]]:
    uis: list[UI] = []
    yield uis
    for ui in uis:
        if ui.proc.poll() is None:
            ui.kill_all()


def test_sigterm_ends_the_ui_tree_busy_port_is_an_error_and_links_use_the_real_port(
    tmp_path: Path, air_home: Path, started: list[UI]
) -> None:
    path = write_workload(
        tmp_path,
        "linked",
        """
        experiment_name: linked
        compute: {num_accelerators: 1, accelerator_type: CPU_1xCPU}
        max_retries: 0
        command: echo trained
    """,
    )
    run_id = submit(path)
    port = free_port()
    ui = UI(tmp_path, port, "--workers", "2")
    started.append(ui)
    tree = ui.wait_ready()
    cmdlines = [" ".join(p.cmdline()) for p in tree]
    # MLflow's app under uvicorn in one process of air's (air.server.mlflow_app), with its 2 workers
    assert any("-m air.server.mlflow_app" in c for c in cmdlines) and sum("spawn_main" in c for c in cmdlines) >= 2, cmdlines
    assert not [c for c in cmdlines if "mlflow.server.jobs" in c or "huey" in c], cmdlines  # no job runner
    assert "Ctrl-C to stop" in ui.log.read_text()

    # A second `air ui` on the same port: exit 1, says the port is busy, by whom, and how to pick another.
    second = air("ui", "--port", str(port), timeout=120)
    assert second.returncode == 1, second.stderr
    assert f"Port {port} on 127.0.0.1 is busy" in second.stderr
    assert f"`air ui` (pid {ui.proc.pid}) already serves this store" in second.stderr
    assert "--port" in second.stderr and "Address already in use" not in second.stderr

    # `air get run` links to the port the UI listens on, not MLflow's default 5000.
    assert wait_terminal(run_id, timeout=180).status.value == "SUCCESS"
    shown = air("get", "run", run_id, "--json")
    assert shown.returncode == 0, shown.stderr
    link = json.dumps(json.loads(shown.stdout)["data"])
    assert f"http://127.0.0.1:{port}/#/experiments/" in link and ":5000/" not in link
    text = air("get", "run", run_id).stdout
    assert f"127.0.0.1:{port}/#/experiments/" in text
    # ... and to the run's page on air's pages (--web-port: port + 1), which names the CLI's way back.
    page = f"http://127.0.0.1:{port + 1}/runs/{run_id}"
    assert json.loads(shown.stdout)["data"]["page_url"] == page and page in text
    with urllib.request.urlopen(page, timeout=60) as response:
        assert response.status == 200 and f"air get run {run_id}" in response.read().decode()

    os.kill(ui.proc.pid, signal.SIGTERM)
    assert ui.proc.wait(timeout=60) == 0
    pids = [p.pid for p in tree]
    wait_for(lambda: not alive(pids), "every process of the UI's tree to end", timeout=30)
    assert port_is_free(port)
    assert not (air_home / "ui.json").exists()
    # No UI runs any more: the link falls back to `air ui`'s default address.
    text = air("get", "run", run_id).stdout
    assert "http://127.0.0.1:5000/#/experiments/" in text and page not in text  # no page served now
    assert json.loads(air("get", "run", run_id, "--json").stdout)["data"]["page_url"] is None


def test_sigkilled_air_ui_takes_mlflow_server_with_it(
    tmp_path: Path, air_home: Path, started: list[UI]
) -> None:
    port = free_port()
    ui = UI(tmp_path, port, "--workers", "2")
    started.append(ui)
    tree = ui.wait_ready()
    assert len(tree) >= 4, [p.cmdline() for p in tree]
    os.kill(ui.proc.pid, signal.SIGKILL)
    ui.proc.wait(timeout=30)
    pids = [p.pid for p in tree]
    wait_for(lambda: not alive(pids), "the guard (pdeathsig) to end the UI's tree", timeout=60)
    assert port_is_free(port)
    # Its stale entry is not a running UI: a new `air ui` takes the port and links follow it.
    from air.tracking import run_url

    assert run_url("r", "1") == "http://127.0.0.1:5000/#/experiments/1/runs/r"


def test_port_held_by_another_program_is_an_error(air_home: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = air("ui", "--port", str(port), timeout=120)
    assert result.returncode == 1, result.stderr
    assert f"Port {port} on 127.0.0.1 is busy: another program listens there." in result.stderr
    assert "Pick another port with --port, e.g. `air ui --port" in result.stderr
    assert not (air_home / "mlflow.db").exists()  # nothing was created for a UI that never started
