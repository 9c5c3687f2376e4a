"""The server's MLflow starts as one process that imports MLflow once (issue 35): air.server.mlflow_app
under air's guard, not `mlflow server`'s CLI process importing all of MLflow's server only to start a
uvicorn process that imports it again. What it serves through the door is MLflow's tracking server as
before: the REST API, the UI page, and proxied artifacts kept in the server's AIR_HOME."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import psutil
from server_helpers import AIR, AirServer, free_port, wait_for

from air.server.mlflow_app import mlflow_environ


def _tagged(prefix: str) -> list[psutil.Process]:
    """Live processes whose AIR_PROCESS_TAG starts with `prefix` (the server's MLflow tree)."""
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get("AIR_PROCESS_TAG", "").startswith(prefix) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


def _ready(srv: AirServer, proc: subprocess.Popen[bytes]) -> bool:
    assert proc.poll() is None, (srv.home / "server" / "server.log").read_text()[-4000:]
    try:
        with urllib.request.urlopen(srv.url + "/api/v1/health", timeout=5) as answer:
            mlflow = json.loads(answer.read())["mlflow"]
    except OSError:
        return False
    assert mlflow["state"] != "failed", mlflow
    return bool(mlflow["state"] == "ready")


def test_the_servers_mlflow_is_one_process_serving_mlflow(tmp_path: Path) -> None:
    srv = AirServer(home=tmp_path / "server-home", port=free_port(), clients=tmp_path / "clients",
                    log=tmp_path / "server.out")
    srv.home.mkdir()
    root = srv.token_create("root", "--admin")
    with open(srv.log, "ab") as out:
        proc = subprocess.Popen([*AIR, "server", "start", "--port", str(srv.port), "--single-trust-domain"],
                                env=srv.server_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    tag = f"air-server-mlflow-{proc.pid}-"
    try:
        wait_for(lambda: _ready(srv, proc), "the server's MLflow to be ready", timeout=300, interval=0.5)
        tree = _tagged(tag)
        commands = [proc.cmdline() for proc in tree]
        guards = [c for c in commands if "air.launcher.guard" in c]
        served = [c for c in commands if "air.launcher.guard" not in c]
        # One guard and one MLflow process; before: the guard, `python -m mlflow ui` and `python -m uvicorn`.
        assert len(guards) == 1 and len(served) == 1, commands
        assert served[0][1:3] == ["-m", "air.server.mlflow_app"], served
        assert not [c for c in commands if "mlflow" in c[1:3] or "uvicorn" in c[1:3]], commands

        # It is MLflow's tracking server as before, through the door: its UI page, its API, proxied artifacts.
        request = urllib.request.Request(srv.url + "/mlflow/", headers={"Authorization": f"Bearer {root}"})
        with urllib.request.urlopen(request, timeout=30) as page:
            assert page.status == 200 and b"<html" in page.read().lower()
        client = ("import sys, mlflow\n"
                  "c = mlflow.MlflowClient(sys.argv[1])\n"
                  "run = c.create_run(c.create_experiment('proxied'))\n"
                  "c.log_text(run.info.run_id, 'kept by the server', 'note.txt')\n"
                  "print(run.info.artifact_uri, [f.path for f in c.list_artifacts(run.info.run_id)])\n")
        clean = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "MLFLOW_TRACKING_TOKEN": root}
        done = subprocess.run([sys.executable, "-c", client, srv.url + "/mlflow"], env=clean, cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("mlflow-artifacts:/") and "['note.txt']" in done.stdout, done.stdout
        kept = list((srv.home / "mlartifacts").rglob("note.txt"))
        assert len(kept) == 1 and kept[0].read_text() == "kept by the server", kept
        assert "Uvicorn running on unix socket" in (srv.home / "server" / "server.log").read_text()
    finally:
        proc.terminate()
        assert proc.wait(timeout=120) == 0, srv.log.read_text()
    wait_for(lambda: not _tagged(tag), "MLflow's processes to end with the server", timeout=60)


def test_mlflow_app_hands_mlflow_the_settings_its_cli_would() -> None:
    """The variable names air.server.mlflow_app sets are the ones MLflow's server reads (a renamed one in a
    newer MLflow would silently serve without proxied artifacts or the /mlflow prefix)."""
    names = ("from mlflow.server import constants as c, handlers as h\n"
             "from mlflow import environment_variables as e\n"
             "print(' '.join([c.BACKEND_STORE_URI_ENV_VAR, c.REGISTRY_STORE_URI_ENV_VAR, c.ARTIFACT_ROOT_ENV_VAR,\n"
             "  c.SERVE_ARTIFACTS_ENV_VAR, c.ARTIFACTS_DESTINATION_ENV_VAR, h.STATIC_PREFIX_ENV_VAR,\n"
             "  e._MLFLOW_SGI_NAME.name, e._MLFLOW_SERVER_BOOT_ID.name, e._MLFLOW_IN_JOB_EXECUTOR.name,\n"
             "  e.MLFLOW_ENABLE_WORKSPACES.name]))\n")
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", names], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.split()) == sorted(mlflow_environ("sqlite:///x.db", "file:///a", "/mlflow")), done.stdout


def test_air_uis_mlflow_is_one_process_too(tmp_path: Path, air_home: Path) -> None:
    """`air ui` serves MLflow's UI on its port the same way: the guard and one air.server.mlflow_app."""
    port, web_port = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "air.cli.main", "ui", "--port", str(port), "--web-port",
                             str(web_port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    tag = f"air-ui-{proc.pid}-"

    def answers() -> bool:
        assert proc.poll() is None, (air_home / "ui.log").read_text()[-4000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ajax-api/2.0/mlflow/experiments/search?max_results=5",
                                        timeout=5) as answer:
                return bool(answer.status == 200 and "experiments" in json.loads(answer.read()))
        except OSError:
            return False

    try:
        wait_for(answers, "air ui's MLflow to answer", timeout=300, interval=0.5)
        commands = [p.cmdline() for p in _tagged(tag)]
        served = [c for c in commands if "air.launcher.guard" not in c]
        assert len(commands) == 2 and len(served) == 1 and served[0][1:3] == ["-m", "air.server.mlflow_app"], commands
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30) as page:  # MLflow's UI page, no prefix
            assert page.status == 200 and b"<html" in page.read().lower()
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    wait_for(lambda: not _tagged(tag), "air ui's MLflow to end with it", timeout=60)


def test_the_job_runner_asked_for_is_mlflow_servers() -> None:
    """MLFLOW_SERVER_ENABLE_JOB_EXECUTION=true (air sets it false unless set) still brings MLflow's job
    runner: mlflow_app hands over to `mlflow server` with the same settings, which starts it."""
    from air.server.mlflow_app import cli_argv, job_runner_on
    from air.tracking.ui import ui_environment

    assert not job_runner_on(ui_environment({}))
    assert job_runner_on(ui_environment({"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "True"}))
    argv = cli_argv("sqlite:///s.db", "file:///a", "/mlflow", socket_path="/run/x y/m.sock")
    assert argv[1:4] == ["-m", "mlflow", "server"] and argv[-2:] == ["--uvicorn-opts", "--uds '/run/x y/m.sock'"], argv
    for flag, value in (("--backend-store-uri", "sqlite:///s.db"), ("--artifacts-destination", "file:///a"),
                        ("--default-artifact-root", "mlflow-artifacts:/"), ("--static-prefix", "/mlflow")):
        assert argv[argv.index(flag) + 1] == value, argv
    assert "--serve-artifacts" in argv
