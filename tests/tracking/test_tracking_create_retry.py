"""The attempt's MLflow run through a tracking server that is away is tried again while the attempt lives
(issue 24): the nodes' run-variables file is written only once it exists (the node hook keeps waiting),
never `{}` early; an attempt that ends first still gets it from the living supervisor, or, after the
late wait, `{}` (hooks then log locally: node_hook.py). The `create` callable stands in for MLflow here:
the retry loop is what is under test (the real server path: tests/server/test_tracking_outage.py)."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from air.tracking.attempt_tracking import WorkloadTracking
from air.tracking.handle import TrackingHandle
from proc_helpers import wait_for

# Nothing listens on port 9 of loopback: air's own calls to it fail at once (refused).
AWAY = "http://127.0.0.1:9"


class Flaky:
    """Fails (None, as start_attempt_run does when the server is away) until `ok` is set."""

    def __init__(self, warn: list[str]) -> None:
        self.ok = threading.Event()
        self.tries = 0
        self.warn = warn

    def __call__(self) -> TrackingHandle | None:
        self.tries += 1
        if not self.ok.is_set():
            return None
        return TrackingHandle("run-abc", "7", AWAY, self.warn.append)


@pytest.mark.timeout(120)
def test_the_run_is_tried_again_until_the_server_answers_and_the_nodes_wait_meanwhile(
        air_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", AWAY)
    lines: list[str] = []
    create = Flaky(lines)
    env_file, hook = tmp_path / "mlflow_env.json", tmp_path / "mlflow_hook"
    tracking = WorkloadTracking(create, attempt=0, env_file=env_file, hook_dir=hook, warn=lines.append)
    env = tracking.env()
    assert env["MLFLOW_TRACKING_URI"] == AWAY and env["PYTHONPATH"] == str(hook)
    assert env["MLFLOW_HTTP_RESPECT_RETRY_AFTER_HEADER"] == "false"
    wait_for(lambda: create.tries >= 2, "a second try", timeout=60)
    assert not env_file.exists()  # hooks keep waiting: no `{}` while the attempt lives
    assert not tracking.wait_ready(0.1)
    create.ok.set()
    assert tracking.wait_ready(60)
    assert json.loads(env_file.read_text()) == {"MLFLOW_RUN_ID": "run-abc", "MLFLOW_EXPERIMENT_ID": "7"}
    assert tracking.handle is not None and tracking.handle.run_id == "run-abc"
    assert sum("tried again in the background" in line for line in lines) == 1


@pytest.mark.timeout(120)
def test_an_attempt_that_ends_first_waits_for_its_run_then_gives_up_with_empty_variables(
        air_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", AWAY)
    monkeypatch.setattr(WorkloadTracking, "CREATE_WAIT_S", 0.5)
    monkeypatch.setattr(WorkloadTracking, "LATE_WAIT_S", 1.0)
    lines: list[str] = []
    create = Flaky(lines)
    env_file = tmp_path / "mlflow_env.json"
    tracking = WorkloadTracking(create, attempt=0, env_file=env_file, hook_dir=tmp_path / "hook", warn=lines.append)
    tracking.end("FINISHED")
    assert json.loads(env_file.read_text()) == {}
    assert any("given up" in line for line in lines), lines
    tries = create.tries
    tracking._thread.join(60)
    assert not tracking._thread.is_alive()  # the retry loop stopped with the attempt's end
    assert create.tries <= tries + 1
    assert tracking.handle is None


@pytest.mark.timeout(120)
def test_nodes_that_need_the_run_id_first_have_their_wait_for_it_said(
        air_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nodes on Ray or Slurm get MLFLOW_RUN_ID in their environment, so they start once the run exists
    (`wait=True`): that wait is said in the supervisor's log (`air run --watch -v`), not silent; once the run
    exists they get it."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", AWAY)
    lines: list[str] = []
    create = Flaky(lines)
    tracking = WorkloadTracking(create, attempt=0, env_file=tmp_path / "mlflow_env.json",
                                hook_dir=tmp_path / "mlflow_hook", warn=lines.append, wait=True)
    answer: list[dict[str, str]] = []
    waiter = threading.Thread(target=lambda: answer.append(tracking.env()))
    waiter.start()
    wait_for(lambda: any("waiting for the attempt's MLflow run" in line for line in lines), "the wait said",
             timeout=60)
    assert not answer  # still waiting
    told = [line for line in lines if "waiting for the attempt's MLflow run" in line]
    assert AWAY in told[0] and "before the nodes start" in told[0], told
    create.ok.set()
    waiter.join(timeout=60)
    assert answer and answer[0]["MLFLOW_RUN_ID"] == "run-abc" and len(told) == 1
