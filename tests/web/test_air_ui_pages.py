"""`air ui` serves air's pages on --web-port beside MLflow's UI on --port, links to MLflow, and ends both
(every process, both ports) on SIGTERM."""

from __future__ import annotations

import os
import signal
import sys
import urllib.request
from pathlib import Path

from runs_helpers import submit, wait_status, wait_terminal, write_workload
from web_helpers import free_port

from proc_helpers import alive, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tracking_runs"))
from test_ui_cli import UI, port_is_free


def test_air_ui_serves_the_pages_beside_mlflow(tmp_path: Path, air_home: Path, cpu_slots: None) -> None:
    run_id = submit(write_workload(tmp_path, "shown", """
        experiment_name: shown
        compute: {num_accelerators: 1, accelerator_type: CPU_1xCPU}
        max_retries: 0
        command: echo "the last line of node 0"
    """))
    assert wait_terminal(run_id, timeout=180).status.value == "SUCCESS"
    stop = tmp_path / "stop"
    active = submit(write_workload(tmp_path, "active", f"""
        experiment_name: active
        compute: {{num_accelerators: 1, accelerator_type: CPU_1xCPU}}
        max_retries: 0
        command: while [ ! -f {stop} ]; do echo tick; sleep 0.2; done
    """))
    port, web_port = free_port(), free_port()
    ui = UI(tmp_path, port, "--web-port", str(web_port), "--workers", "1")
    try:
        tree = ui.wait_ready()  # MLflow answers on --port
        log = ui.log.read_text()
        assert f"air pages (runs, logs, queue, capacity) at http://127.0.0.1:{web_port}" in log, log
        with urllib.request.urlopen(f"http://127.0.0.1:{web_port}/runs", timeout=60) as response:
            page = response.read().decode()
        assert run_id in page and "SUCCESS" in page
        assert f'href="http://127.0.0.1:{port}" id="mlflow-link"' in page
        with urllib.request.urlopen(f"http://127.0.0.1:{web_port}/runs/{run_id}", timeout=60) as response:
            assert "the last line of node 0" in response.read().decode()
        # A browser following a live log keeps a stream open: `air ui` still stops at once.
        wait_status(active, "RUNNING", timeout=180)
        stream = urllib.request.urlopen(f"http://127.0.0.1:{web_port}/runs/{active}/logs/stream", timeout=60)
        assert stream.readline().startswith(b": following")
        os.kill(ui.proc.pid, signal.SIGTERM)
        assert ui.proc.wait(timeout=60) == 0
        stream.close()
        wait_for(lambda: not alive([p.pid for p in tree]), "every process of `air ui` to end", timeout=30)
        assert port_is_free(port) and port_is_free(web_port)
    finally:
        stop.touch()
        if ui.proc.poll() is None:
            ui.kill_all()
    assert wait_terminal(active, timeout=180).status.value == "SUCCESS"


def test_with_a_tracking_server_air_ui_serves_only_its_pages(
    tmp_path: Path, air_home: Path, cpu_slots: None, monkeypatch: object
) -> None:
    """MLFLOW_TRACKING_URI=http…: the server has its own UI; `air ui` serves air's pages, linking there."""
    import subprocess

    port = free_port()
    server = f"http://127.0.0.1:{free_port()}"  # nothing needs to answer there: only linked to
    log = tmp_path / "ui.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "air.cli.main", "ui", "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "MLFLOW_TRACKING_URI": server,
                                     "PYTHONFAULTHANDLER": "1"})  # (a crash at exit says where, in the log)
    try:
        def answers() -> bool:
            assert proc.poll() is None, log.read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port + 1}/runs", timeout=5) as response:
                    return f'href="{server}" id="mlflow-link"' in response.read().decode()
            except OSError:
                return False

        wait_for(answers, "air's pages on --port + 1", timeout=120, interval=0.3)
        assert port_is_free(port)  # no MLflow UI of its own
        from air.tracking.ui import pages_base_url, running_ui

        # Noted for `air get run`'s page link; never taken for an MLflow UI of the server's store.
        assert pages_base_url(store=server) == f"http://127.0.0.1:{port + 1}" and running_ui(server) is None
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()
        assert port_is_free(port + 1)
        assert pages_base_url(store=server) is None and not (air_home / "ui.json").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
