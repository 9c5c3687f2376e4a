"""The run controller's listeners (air/runs/listeners/), each run for real: the transitions a controller
publishes (test_controller.py's fake backend, the real SQLite store), the status lines, progress.json,
the run's MLflow credential behind a door, and one MLflow run per attempt in a tmp MLflow store. The
controller itself names none of them."""

from __future__ import annotations

import ast
import json
from collections.abc import Callable
from pathlib import Path

import pytest
from test_controller import FAILED, OK, FakeBackend, FakeJob, make_controller, new_run

import air.runs.controller
from air.runs.controller import RunController
from air.runs.credentials import verify
from air.runs.listeners.audit import AuditListener
from air.runs.listeners.credentials import CredentialsListener
from air.runs.listeners.progress import ProgressListener
from air.runs.transitions import Change, Phase, RunListener, Transition
from air.settings import AIR_MLFLOW_DOOR
from air.store.paths import RunPaths
from air.store.run_store import RunStore
from air.store.states import AttemptStatus, RetryPolicy, RunStatus
from air.tracking.attempt_tracking import AttemptTracking


@pytest.fixture
def store(air_home: Path) -> RunStore:
    return RunStore()


class Recorder(RunListener):
    def __init__(self) -> None:
        self.seen: list[Transition] = []

    def on_transition(self, t: Transition) -> None:
        self.seen.append(t)


def test_the_controller_module_imports_no_listener() -> None:
    """Whoever builds a controller passes its listeners: its module imports none of them, nor the effects
    they own (MLflow, run credentials, the tracking back-fill)."""
    tree = ast.parse(Path(air.runs.controller.__file__).read_text())
    imported = {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    owned = ("air.runs.listeners", "air.tracking", "air.runs.credentials", "air.runs.reconcile")
    assert not [name for name in imported if name.startswith(owned)], imported
    assert "air.runs.transitions" in imported


def test_a_retried_run_publishes_its_changes_in_order(store: RunStore) -> None:
    run_id = new_run(store)
    recorder = Recorder()
    controller = RunController(run_id, FakeJob(), FakeBackend([FAILED, OK]), store, RetryPolicy(1),
                               listeners=[recorder])
    assert controller.run() is RunStatus.SUCCESS
    kinds = [(t.kind, t.attempt, t.after) for t in recorder.seen if t.kind is not Change.STEP]
    assert kinds == [
        (Change.RUN, None, RunStatus.QUEUED), (Change.RUN, None, RunStatus.RUNNING),
        (Change.ATTEMPT_STARTED, 0, AttemptStatus.RUNNING), (Change.PROGRESS, 0, None),
        (Change.ATTEMPT_ENDING, 0, None), (Change.ATTEMPT_ENDED, 0, AttemptStatus.FAILED),
        (Change.RUN, None, RunStatus.WAITING_FOR_RETRY),
        (Change.RUN, None, RunStatus.QUEUED), (Change.RUN, None, RunStatus.RUNNING),
        (Change.ATTEMPT_STARTED, 1, AttemptStatus.RUNNING), (Change.PROGRESS, 1, None),
        (Change.ATTEMPT_ENDED, 1, AttemptStatus.SUCCESS), (Change.RUN, None, RunStatus.SUCCESS),
        (Change.RUN_ENDED, None, None)]
    ending, ended = (t for t in recorder.seen if t.kind in (Change.ATTEMPT_ENDING, Change.ATTEMPT_ENDED)
                     and t.attempt == 0)
    assert ending.retry and ended.retry and ended.reason == "exit 3" and not ended.canceled
    assert recorder.seen[-1].status is RunStatus.SUCCESS and all(t.run_id == run_id for t in recorder.seen)
    started = next(t for t in recorder.seen if t.kind is Change.STEP and t.after is Phase.WAIT)
    assert started.before is Phase.START and started.handle is not None and started.allocation is not None


def test_the_audit_listener_writes_one_status_line_per_run_state(store: RunStore) -> None:
    run_id = new_run(store)
    lines: list[str] = []
    assert RunController(run_id, FakeJob(), FakeBackend([OK]), store, RetryPolicy(0),
                         listeners=[AuditListener(lines.append)]).run() is RunStatus.SUCCESS
    assert lines == ["status QUEUED", "status RUNNING", "status SUCCESS"]


def test_the_progress_listener_writes_progress_json(store: RunStore) -> None:
    run_id = new_run(store)
    RunPaths(run_id).create_attempt(0)
    processes = ({"name": "node 0", "node": 0, "process": 0, "silent_s": 12.5, "stopped": False},)
    ProgressListener().on_transition(Transition(Change.PROGRESS, run_id, attempt=0, processes=processes,
                                                ended=({"node": 1, "ended_at": 5.0},)))
    written = json.loads(RunPaths(run_id).progress(0).read_text())
    assert written["processes"] == list(processes) and written["ended"] == [{"node": 1, "ended_at": 5.0}]
    assert written["at"] > 0
    other = new_run(store)  # other changes write nothing
    ProgressListener().on_transition(Transition(Change.ATTEMPT_STARTED, other, attempt=0))
    assert not RunPaths(other).progress(0).exists()


def test_the_credentials_listener_mints_one_credential_behind_a_door_and_revokes_it(
        store: RunStore, monkeypatch: pytest.MonkeyPatch) -> None:
    run_id = new_run(store)
    store.transition(run_id, RunStatus.QUEUED)
    store.transition(run_id, RunStatus.RUNNING)
    listener = CredentialsListener(store)
    started = Transition(Change.ATTEMPT_STARTED, run_id, attempt=0)
    tracking_env = {"MLFLOW_TRACKING_URI": "http://127.0.0.1:5000", "MLFLOW_RUN_ID": "abc"}
    assert listener.node_env(started, dict(tracking_env)) == tracking_env  # no door: as it is, nothing minted
    assert store.reader().execute("SELECT COUNT(*) FROM run_credentials").fetchone()[0] == 0

    monkeypatch.setenv(AIR_MLFLOW_DOOR, "https://air.example/mlflow")
    env = listener.node_env(started, dict(tracking_env))
    assert env["MLFLOW_TRACKING_URI"] == "https://air.example/mlflow" and env["MLFLOW_RUN_ID"] == "abc"
    credential = env["MLFLOW_TRACKING_TOKEN"]
    assert (holder := verify(store, credential)) is not None and holder.run_id == run_id
    again = listener.node_env(Transition(Change.ATTEMPT_STARTED, run_id, attempt=1), {})
    assert again["MLFLOW_TRACKING_TOKEN"] == credential  # one credential per run, every attempt's nodes
    assert store.reader().execute("SELECT COUNT(*) FROM run_credentials").fetchone()[0] == 1
    listener.on_transition(Transition(Change.RUN_ENDED, run_id, status=RunStatus.RUNNING))
    assert verify(store, credential) is None


class MlflowJob(FakeJob):
    """Each attempt gets a real MLflow run (made here and now) in the test's MLflow store."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[str | None] = []  # each attempt's MLflow run id

    def tracking(self, attempt: int, warn: Callable[[str], None]) -> AttemptTracking:
        made = AttemptTracking.for_workload(experiment="listeners", run_name=None, tags={}, params={"lr": 0.1},
                                            attempt=attempt, warn=warn)
        self.made.append(made.handle and made.handle.run_id)
        return made


def test_the_tracking_listener_makes_links_and_ends_one_mlflow_run_per_attempt(
        store: RunStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    run_id = new_run(store)
    job = MlflowJob()
    assert make_controller(run_id, job, FakeBackend([FAILED, OK]), store, RetryPolicy(1)).run() is RunStatus.SUCCESS
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    attempts = store.list_attempts(run_id)
    assert [a.mlflow_run_id for a in attempts] == job.made and None not in job.made
    for attempt, status in zip(attempts, ["FAILED", "FINISHED"], strict=True):
        assert attempt.mlflow_run_id is not None
        assert client.get_run(attempt.mlflow_run_id).info.status == status
        ref = json.loads(RunPaths(run_id).tracking(attempt.index).read_text())
        assert ref["run_id"] == attempt.mlflow_run_id
    assert store.get_run(run_id).mlflow_run_id == attempts[-1].mlflow_run_id
