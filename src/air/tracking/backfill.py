"""Every ended attempt has its MLflow run, whatever the tracking server's state when it ran (issue 24).

An attempt whose MLflow run could not be made (the tracking server was away: "the attempt runs without
MLflow tracking") leaves `attempt_<a>/mlflow_env.json` as `{}` and no `mlflow_run_id`. Once the attempt
has ended, `backfill_later` makes its run afterwards: the run's experiment and name, air's attempt tags,
the workload's parameters, its node logs as artifacts, its start and end time and the status that matches
the attempt's. Like tracking/ended.py it runs in a short detached process (`python -m air.tracking.backfill
RUN_ID`): `import mlflow` and a server that is still away (the MLflow client's retries) belong in no `air`
command's path. A back-filled attempt's run is noted in its `tracking.json` (the store's id is taken from
there, as for any attempt: ended.refs_of) and is not made again. air's runs layer finds the attempts
(runs/reconcile.py); this module knows only files and MLflow.

A job may name the run's "tracking pending" marker (reconcile.py `backfill_pending`): the process then holds
an exclusive lock on it while it works and skips attempts whose note exists by the time it holds it, so two
passes of `air server` (or a pass and reconcile) never make one attempt's run twice; the marker itself is
removed by the server's next pass, once nothing is missing.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from air.processes import PROCESS_KINDS
from air.settings import AIR_MLFLOW_DOOR
from air.tracking.client_only import tracking_client_only
from air.tracking.ended import note

if TYPE_CHECKING:
    from collections.abc import Callable

    from mlflow import MlflowClient

    from air.tracking.handle import TrackingHandle

#: An ended air attempt's status (AttemptStatus's value) in MLflow; anything else ends FAILED.
MLFLOW_STATUS = {"SUCCESS": "FINISHED", "CANCELED": "KILLED"}
#: Metric values per request when a node's local store is copied (MLflow's log-batch limit is 1000).
MAX_METRICS_PER_BATCH = 1000
#: Per-request limit of those copies through an http(s) server.
SPOOL_HTTP_TIMEOUT_S = 60


def missing(env_file: Path, ref: Path, mlflow_run_id: str | None, hook_dir: Path | None = None) -> bool:
    """The attempt ran with tracking on but its MLflow run was never made: its run-variables file says
    `{}` (node_hook.write_env: no run), or is absent beside the node hook's folder (its supervisor died
    while still trying to make it), the store has no id and no back-fill wrote its tracking note."""
    if mlflow_run_id or ref.exists():
        return False
    if hook_dir is not None and hook_dir.is_dir() and not env_file.exists():
        return True
    try:
        return bool(json.loads(env_file.read_text()) == {})
    except (OSError, ValueError):
        return False


class BackfillAttempt(TypedDict):
    """One ended attempt whose MLflow run is to be made (air.runs.reconcile.backfill_tracking)."""

    index: int
    status: str
    started_at: float
    ended_at: float | None
    ref: str
    node_logs: dict[str, str]
    spool: str  # what its nodes logged locally meanwhile (node_hook.spool_of), copied in


class _Job(TypedDict):
    """What the detached back-fill process is handed (as JSON on its command line)."""

    experiment: str
    run_name: str | None
    params_file: str
    tags: dict[str, str]
    attempts: list[BackfillAttempt]


class BackfillJob(_Job, total=False):
    """A job, and optionally the run's "tracking pending" marker (held locked while the job works)."""

    marker: str


def backfill_later(job: BackfillJob, log: Path) -> bool:
    """Make the missing MLflow runs of `job` (see `_backfill`) in a detached process whose lines go to
    `log` (the run's supervisor.log); False when it could not start (a line in `log`)."""
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            subprocess.Popen(PROCESS_KINDS["backfill"].argv(json.dumps(job)),
                             stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True,
                             close_fds=True)
    except (OSError, TypeError, ValueError) as exc:
        note(log, f"could not start the MLflow back-fill: {exc}")
        return False
    return True


def _backfill(job: BackfillJob) -> int:
    """`job`: experiment, run_name, tags, params_file and attempts, each with index, status (air's),
    started_at, ended_at, node_logs ({node: path}) and ref (its tracking note, written once made); with
    `marker`, only while this process holds it locked (see the module's docstring).
    1 when a run could not be made or ended (a later pass tries again: the note is written only when
    the run was made)."""
    marker = job.get("marker")
    if marker is None:
        return _make_runs(job)
    try:
        held = os.open(marker, os.O_RDONLY)
    except FileNotFoundError:
        return 0  # removed meanwhile: a pass found nothing missing
    try:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return 0  # another back-fill of this run is at work: it makes them
        return _make_runs(job)
    finally:
        os.close(held)


def _make_runs(job: BackfillJob) -> int:
    from air.tracking.attempt import start_attempt_run
    from air.tracking.handle import write_tracking_ref
    from air.tracking.store import client, http_limits

    door = os.environ.get(AIR_MLFLOW_DOOR)  # under `air server`: links name its door, as the supervisor's do
    failed = 0
    for attempt in job["attempts"]:
        index = int(attempt["index"])
        if Path(attempt["ref"]).exists():
            continue  # made meanwhile (an earlier back-fill): never twice
        tags = {**job["tags"], "air.attempt": str(index), "air.backfilled": "true"}
        handle = start_attempt_run(job["experiment"], job.get("run_name"), tags=tags,
                                   params=_parameters(Path(job["params_file"])), warn=_say)
        if handle is None:
            failed += 1
            continue
        for node, log in sorted(attempt["node_logs"].items()):
            if Path(log).is_file():
                handle.log_node_log(log, index, int(node))
        if attempt.get("spool"):
            copy_spool(Path(attempt["spool"]), handle, _say)
        status = MLFLOW_STATUS.get(str(attempt["status"]), "FAILED")
        try:
            with http_limits(handle.tracking_uri):
                client(handle.tracking_uri).set_terminated(
                    handle.run_id, status, end_time=int(float(attempt.get("ended_at") or time.time()) * 1000))
        except Exception as exc:  # the run exists; it is noted, and its status said here
            _say(f"could not end the back-filled MLflow run {handle.run_id}: {exc}")
            failed += 1
        write_tracking_ref(Path(attempt["ref"]), dataclasses.replace(handle, tracking_uri=door) if door else handle)
        _say(f"attempt {index}'s MLflow run {handle.run_id} made afterwards ({status}): the tracking server "
             "was away while it ran")
    return 1 if failed else 0


def copy_spool(spool: Path, handle: TrackingHandle, warn: Callable[[str], None]) -> int:
    """Copy what node processes logged locally while the attempt's run did not exist yet (node_hook.py:
    one local MLflow store per process under `spool`) into `handle`'s run: metrics with their steps and
    times, parameters, tags, artifacts. Each store copied is renamed `*.copied` (never copied twice).
    Returns how many metric values were copied."""
    if not spool.is_dir():
        return 0
    stores = [d for d in sorted(spool.iterdir())
              if d.is_dir() and not d.is_symlink() and not d.name.endswith(".copied")]
    if not stores:
        return 0
    from air.tracking.store import client, http_limits

    copied = 0
    previous = os.environ.get("MLFLOW_ALLOW_FILE_STORE")
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # (MLflow reads it when a file store is opened)
    try:
        with http_limits(handle.tracking_uri, SPOOL_HTTP_TIMEOUT_S):
            target = client(handle.tracking_uri)
            for store in stores:
                try:
                    copied += _copy_store(store, target, handle.run_id)
                    store.rename(store.with_name(store.name + ".copied"))
                except Exception as exc:  # tracking never fails a run; the store stays for a later pass
                    warn(f"tracking: could not copy the locally logged MLflow data of {store}: {exc}")
    finally:
        if previous is None:
            os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)
        else:
            os.environ["MLFLOW_ALLOW_FILE_STORE"] = previous
    if copied:
        warn(f"tracking: {copied} metric values logged before the attempt's MLflow run existed copied into it")
    return copied


def _copy_store(store: Path, target: MlflowClient, run_id: str) -> int:
    """Every run of one local store into `run_id`; the number of metric values."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param, RunTag, ViewType

    local = MlflowClient(store.as_uri())
    copied = 0
    for experiment in local.search_experiments(view_type=ViewType.ALL):
        for run in local.search_runs([experiment.experiment_id], run_view_type=ViewType.ALL, max_results=50000):
            metrics = [Metric(m.key, m.value, m.timestamp, m.step) for key in run.data.metrics
                       for m in local.get_metric_history(run.info.run_id, key)]
            for start in range(0, len(metrics), MAX_METRICS_PER_BATCH):
                target.log_batch(run_id, metrics=metrics[start:start + MAX_METRICS_PER_BATCH])
            copied += len(metrics)
            for key, value in run.data.params.items():
                try:
                    target.log_batch(run_id, params=[Param(key, value)])
                except Exception:  # the attempt's run already has it (another value): its own wins
                    pass
            tags = [RunTag(k, v) for k, v in run.data.tags.items() if not k.startswith("mlflow.")]
            if tags:
                target.log_batch(run_id, tags=tags)
            _copy_artifacts(store, Path(run.info.artifact_uri.removeprefix("file://")), target, run_id)
    return copied


def _copy_artifacts(store: Path, artifacts: Path, target: MlflowClient, run_id: str) -> None:
    """The regular files of a spooled run's artifact folder, only where it lies inside its store: a node
    writes the store, so its `artifact_uri` or a link in it must not make the copier read another file."""
    if not artifacts.resolve().is_relative_to(store.resolve()) or not artifacts.is_dir():
        return
    for path in sorted(artifacts.rglob("*")):  # (rglob does not enter linked folders)
        if path.is_symlink() or not path.is_file():
            continue
        folder = path.parent.relative_to(artifacts)
        target.log_artifact(run_id, str(path), None if folder == Path(".") else folder.as_posix())


def _parameters(path: Path) -> dict[str, object]:
    try:
        import yaml

        loaded = yaml.safe_load(path.read_text())
    except (OSError, ValueError, ImportError):
        return {}
    except Exception:  # yaml's own errors: a run without readable parameters is still back-filled
        return {}
    return loaded if isinstance(loaded, dict) else {}


def _say(message: str) -> None:
    print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} [air] tracking: {message}", flush=True)


if __name__ == "__main__":
    tracking_client_only()
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "3")  # a server that is still away: give up in seconds
    sys.exit(_backfill(json.loads(sys.argv[1])))
