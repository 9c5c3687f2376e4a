"""A local call recorded in MLflow: one MLflow run per call, rank logs as artifacts, status at the end;
and in the run store as a run of kind `call` (record.py), written by a background thread.

Tracking never decides whether training runs: failures are one warning line. When the caller already
uses MLflow, the run is made before the ranks start (quick, and it must see the caller's active run,
which MLflow keeps per thread). Otherwise it is made on demand when a rank imports mlflow (see
mlflow_gate.py); and a call whose ranks never did is recorded after it returns, by a short-lived
recorder process, so the caller does not pay an `import mlflow` for it.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from air.distributed.local import run_local
from air.distributed.shape import LocalShape
from air.files import atomic_write_text
from air.settings import AIR_MLFLOW_ENV_FILE, AIR_PROCESS_TAG
from air.tracking.store import tracking_enabled

if TYPE_CHECKING:
    from air.runs.paths import CallPaths


def _warn(message: str) -> None:
    sys.stderr.write(f"[air] {message}\n")


class CallTracking:
    """The MLflow run of one call, created off the critical path."""

    def __init__(self, func_name: str, paths: CallPaths, tags: Mapping[str, str]) -> None:
        self.paths = paths
        self.env_file = paths.mlflow_env
        self.handle: Any = None
        self._thread: threading.Thread | None = None
        self._func_name = func_name
        self._tags = dict(tags)
        self._done = threading.Event()
        self.enabled = tracking_enabled()
        if not self.enabled:
            self._write({})
        elif "mlflow" in sys.modules:
            self._start()
        else:
            self._thread = threading.Thread(target=self._on_request, name="air-mlflow-call", daemon=True)
            self._thread.start()

    def _on_request(self) -> None:
        request = self.paths.mlflow_request
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
        except Exception as exc:  # noqa: BLE001 - tracking never fails a call
            _warn(f"tracking: {exc}")
        finally:
            self._write(values)

    def finish(self, status: str, log_paths: Sequence[Path], run_id: str | None = None) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=120)
        if self.handle is None:
            if self.enabled and not self.env_file.exists():
                self._record_later(status, log_paths, run_id)
            return
        for rank, path in enumerate(log_paths):
            self.handle.log_rank_log(path, rank)
        self.handle.end(status)
        try:
            from air.tracking import run_url

            url = run_url(self.handle.run_id, self.handle.experiment_id)
        except Exception:
            url = ""
        _warn(f"MLflow run {self.handle.run_id} (experiment {self.handle.experiment_id})"
              + (f": {url}  (start the UI with `air ui`)" if url and "sqlite" in self.handle.tracking_uri else ""))


    def _record_later(self, status: str, log_paths: Sequence[Path], run_id: str | None) -> None:
        """Record a call no rank asked MLflow about, in a detached process that exits when done."""
        import subprocess

        job = self.paths.mlflow_record_job
        atomic_write_text(job, json.dumps({"func_name": self._func_name, "tags": self._tags, "status": status,
                                           "logs": [str(p) for p in log_paths], "run_id": run_id,
                                           "env_file": str(self.env_file)}))
        with open(job.with_suffix(".log"), "ab") as log:
            subprocess.Popen([sys.executable, "-m", "air.distributed.tracked", str(job)], stdin=subprocess.DEVNULL,
                             stdout=log, stderr=log, start_new_session=True, close_fds=True,
                             env={k: v for k, v in os.environ.items() if k != AIR_PROCESS_TAG})


def experiment_name(handle: Any) -> str | None:
    """The name of the MLflow experiment a call's run went into (`air get run`/`list runs` show it); None
    when MLflow cannot say (the record keeps its first guess)."""
    try:
        from air.tracking.store import client

        return str(client(handle.tracking_uri).get_experiment(handle.experiment_id).name) or None
    except Exception:  # noqa: BLE001 - tracking never fails a call
        return None


def record_call(job_file: Path) -> int:
    """The recorder process: make the call's MLflow run after the fact, with its logs and status.

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
    for rank, path in enumerate(job["logs"]):
        handle.log_rank_log(Path(path), rank)
    handle.end(job["status"])
    atomic_write_text(job["env_file"], json.dumps(dict(handle.env())))
    if job.get("run_id"):  # link the call's run to its MLflow run (`air get run` shows it)
        try:
            from air.runs.store import RunStore

            RunStore().set_mlflow_run_id(job["run_id"], handle.run_id, attempt=0,
                                         experiment=experiment_name(handle))
        except Exception as exc:  # noqa: BLE001 - the MLflow run stands either way
            _warn(f"run store: {exc}")
    return 0


def run_local_tracked(func: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any], shape: LocalShape,
                      timeout_s: float | None, *, hang_timeout_s: float | None = None) -> list[Any]:
    """A local call, recorded as a run of kind `call` (record.py) and as an MLflow run, both off its path."""
    from air.distributed.record import CallEnd, LocalCallRecord, end_of
    from air.errors import WorkloadFailureException
    from air.runs.paths import CallPaths, new_run_id, process_tag

    name = getattr(func, "__name__", "fn")
    run_id = new_run_id()
    paths = CallPaths(run_id)
    call_dir = paths.create()
    record = LocalCallRecord(run_id, name=name, accelerator_type=shape.accelerator.name,
                             world_size=shape.world_size)
    tracking = CallTracking(name, paths, {
        "air.call": call_dir.name, "air.run_id": run_id, "air.accelerator_type": shape.accelerator.name,
        "air.num_accelerators": str(shape.world_size), "air.num_nodes": "1"})
    status = "FAILED"
    end = CallEnd("FAILED", "The call ended without a result.")
    log_paths = paths.rank_log_list(shape.world_size)
    try:
        values, _ = run_local(func, args, kwargs, shape, timeout_s, call_dir=call_dir, tag=process_tag(run_id),
                              hang_timeout_s=hang_timeout_s,
                              extra_env={AIR_MLFLOW_ENV_FILE: str(tracking.env_file)})
        status = "FINISHED"
        end = CallEnd("SUCCESS")
        return values
    except KeyboardInterrupt as exc:
        status = "KILLED"
        end = end_of(exc)
        raise
    except BaseException as exc:
        end = end_of(exc)
        if record.canceled.is_set():
            status = "KILLED"
            raise WorkloadFailureException(
                f"Run {run_id} ({name}) was canceled (air cancel); every rank was ended.") from None
        raise
    finally:
        try:
            tracking.finish(status, log_paths, run_id=run_id)
        finally:
            handle = tracking.handle
            record.finish(CallEnd(end.status, end.reason, end.failure_class,
                                  handle.run_id if handle is not None else None,
                                  experiment_name(handle) if handle is not None else None))


if __name__ == "__main__":
    sys.exit(record_call(Path(sys.argv[1])))
