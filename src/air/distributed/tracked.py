"""The MLflow run of a local call's attempt, made off the call's path (the controller's AttemptTracking,
made lazily).

Tracking never decides whether training runs: failures are one warning line. When the caller already
uses MLflow, the run is made before the ranks start (quick, and it must see the caller's active run,
which MLflow keeps per thread). Otherwise it is made on demand when a rank imports mlflow (see
mlflow_gate.py); and an attempt whose ranks never did is recorded after it ended, by a short-lived
recorder process (`python -m air.distributed.tracked JOB`), so the caller does not pay an
`import mlflow` for it.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from air.files import atomic_write_text
from air.processes import PROCESS_KINDS
from air.settings import AIR_MLFLOW_ENV_FILE, AIR_PROCESS_TAG
from air.store.paths import CallPaths
from air.tracking.attempt_tracking import AttemptTracking
from air.tracking.client_only import tracking_client_only
from air.tracking.handle import TrackingHandle, write_tracking_ref
from air.tracking.store import tracking_enabled
from air.tracking.sysmetrics import TakeSamples


def _warn(message: str) -> None:
    sys.stderr.write(f"[air] {message}\n")


class LazyCallTracking(AttemptTracking):
    """One attempt's MLflow run, created when the caller already uses MLflow or a rank asks for it."""

    def __init__(self, run_id: str, attempt: int, func_name: str, tags: Mapping[str, str],
                 warn: Callable[[str], None]) -> None:
        super().__init__(None, attempt, warn)
        self.paths = CallPaths(run_id)
        self.run_id = run_id
        self.env_file = self.paths.mlflow_env(attempt)
        self._func_name = func_name
        self._tags = dict(tags)
        self._thread: threading.Thread | None = None
        self._done = threading.Event()
        self.enabled = tracking_enabled()
        self.paths.create_attempt(attempt)
        if not self.enabled:
            self._write({})
        elif "mlflow" in sys.modules:
            self._start()  # before the ranks, in the caller's thread: it sees the caller's active run
        else:
            self._thread = threading.Thread(target=self._on_request, name="air-mlflow-call", daemon=True)
            self._thread.start()

    def env(self) -> dict[str, str]:
        """The ranks read the run's variables from this file once it exists (mlflow_gate.py)."""
        return {AIR_MLFLOW_ENV_FILE: str(self.env_file)}

    def start_samplers(self, gpus_per_node: Sequence[Sequence[str]] | None, num_nodes: int,
                       take_samples: TakeSamples | None = None) -> None:
        """None: a local call's MLflow run does not exist while its ranks start (and a call is short)."""

    def _on_request(self) -> None:
        request = self.paths.mlflow_request(self.attempt)
        while not self._done.is_set():
            if request.exists():
                self._start()
                return
            self._done.wait(0.05)

    def _write(self, values: Mapping[str, str]) -> None:
        atomic_write_text(self.env_file, json.dumps(dict(values)))

    def _start(self) -> None:
        values: dict[str, str] = {}
        try:
            from air.tracking import start_call_run

            self.handle = start_call_run(self._func_name, tags=self._tags, warn=_warn)
            if self.handle is not None:
                values = dict(self.handle.env())
        except Exception as exc:  # tracking never fails a call
            _warn(f"tracking: {exc}")
        finally:
            self._write(values)

    def end(self, status: str, reason: str | None = None, *, node_logs: Mapping[int, Path] | None = None,
            rank_logs: Mapping[int, Path] | None = None) -> None:
        """Attach the rank logs and end the run; one made on a rank's request is linked to the call's
        run here; none made: a recorder process makes it after the call returned."""
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=120)
        handle = self.handle
        if handle is None:
            if self.enabled and not self.env_file.exists():
                self._record_later(status, rank_logs or {})
            return
        _link(self.run_id, self.attempt, handle)  # with the experiment MLflow put it in
        super().end(status, reason, rank_logs=rank_logs)
        try:
            from air.tracking import run_url

            url = run_url(handle.run_id, handle.experiment_id)
        except Exception:
            url = ""
        _warn(f"MLflow run {handle.run_id} (experiment {handle.experiment_id})"
              + (f": {url}  (start the UI with `air ui`)" if url and "sqlite" in handle.tracking_uri else ""))

    def _record_later(self, status: str, rank_logs: Mapping[int, Path]) -> None:
        """Record an attempt no rank asked MLflow about, in a detached process that exits when done."""
        import subprocess

        job = self.paths.mlflow_record_job(self.attempt)
        atomic_write_text(job, json.dumps({
            "func_name": self._func_name, "tags": self._tags, "status": status, "run_id": self.run_id,
            "attempt": self.attempt, "logs": {str(r): str(p) for r, p in rank_logs.items()},
            "env_file": str(self.env_file)}))
        with open(job.with_suffix(".log"), "ab") as log:
            subprocess.Popen(PROCESS_KINDS["recorder"].argv(str(job)), stdin=subprocess.DEVNULL,
                             stdout=log, stderr=log, start_new_session=True, close_fds=True,
                             env={k: v for k, v in os.environ.items() if k != AIR_PROCESS_TAG})


def experiment_name(handle: TrackingHandle) -> str | None:
    """The name of the MLflow experiment a call's run went into (`air get run`/`list runs` show it); None
    when MLflow cannot say (the record keeps its first guess)."""
    try:
        from air.tracking.store import client

        return str(client(handle.tracking_uri).get_experiment(handle.experiment_id).name) or None
    except Exception:  # tracking never fails a call
        return None


def _link(run_id: str, attempt: int, handle: TrackingHandle) -> None:
    """Name the attempt's MLflow run in the run store and its `tracking.json` (`air get run` shows it)."""
    try:
        from air.store.run_store import RunStore

        RunStore().set_mlflow_run_id(run_id, handle.run_id, attempt=attempt, experiment=experiment_name(handle))
        write_tracking_ref(CallPaths(run_id).tracking(attempt), handle)
    except Exception as exc:
        _warn(f"run store: {exc}")


def record_call(job_file: Path) -> int:
    """The recorder process: make the attempt's MLflow run after the fact, with its logs and status.

    Recorders of one AIR_HOME take turns (a file lock): each imports mlflow (~2 s of CPU), and a loop of
    quick calls would otherwise start that many at once."""
    import fcntl

    from air.home import AirHome

    with open(AirHome().mlflow_recorder_lock, "a") as lock:  # released when the process ends
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _record(job_file)


def _record(job_file: Path) -> int:
    from air.tracking import start_call_run

    job = json.loads(job_file.read_text())
    handle = start_call_run(job["func_name"], tags=job["tags"], warn=_warn)
    if handle is None:
        return 1
    for rank, path in job["logs"].items():
        handle.log_rank_log(Path(path), int(rank))
    handle.end(job["status"])
    atomic_write_text(job["env_file"], json.dumps(dict(handle.env())))
    _link(job["run_id"], int(job["attempt"]), handle)
    return 0


if __name__ == "__main__":
    tracking_client_only()
    sys.exit(record_call(Path(sys.argv[1])))
