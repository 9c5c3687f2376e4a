"""End the MLflow runs of an attempt whose supervisor cannot (issue 24: nothing stays RUNNING in MLflow).

A supervisor that was SIGKILLed never ends its attempt's MLflow run; reconcile (air/runs/reconcile.py)
marks the air run INTERNAL_ERROR and hands its MLflow runs here. Ending them needs `import mlflow` (1–2 s
of CPU) and, with a tracking server that is away, the MLflow client's retries (minutes): neither belongs
in whichever `air` command happened to notice. So a short detached process (`python -m
air.tracking.ended JOB`) ends them, appending one line per run to a log the caller names (the run's
`supervisor.log`), and exits. A run already ended (by its supervisor, or a previous reconcile) is left
as it is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from air.processes import PROCESS_KINDS
from air.tracking.client_only import tracking_client_only
from air.tracking.handle import END_STATUSES, EndStatus

#: MLflow statuses of a run nobody has ended yet.
_OPEN = ("RUNNING", "SCHEDULED")


def end_orphaned(runs: Iterable[tuple[str, str | None]], status: EndStatus, *, log: Path,
                 tracking_uri: str | None = None) -> bool:
    """End each MLflow run (`(mlflow_run_id, tracking_uri or None)`) with `status` if it is still open,
    in a detached process; False when there was none to end or the process could not start (a warning
    line in `log`). `tracking_uri` is the store for runs that name none (default: air's own)."""
    if status not in END_STATUSES:
        raise ValueError(f"status must be one of {', '.join(END_STATUSES)}, got {status!r}")
    if tracking_uri is None:
        from air.tracking.store import tracking_uri as default_uri

        tracking_uri = default_uri()
    jobs = list(dict.fromkeys((run_id, uri or tracking_uri) for run_id, uri in runs if run_id))
    if not jobs:
        return False
    job = json.dumps({"status": status, "runs": jobs})
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            subprocess.Popen(PROCESS_KINDS["ended"].argv(job), stdin=subprocess.DEVNULL,
                             stdout=out, stderr=out, start_new_session=True, close_fds=True)
    except OSError as exc:
        note(log, f"could not end the MLflow run(s) {', '.join(r for r, _ in jobs)}: {exc}")
        return False
    return True


def refs_of(pairs: Iterable[tuple[str | None, Path]]) -> list[tuple[str, str | None]]:
    """(mlflow_run_id, tracking_uri) for each (id from the run store, the attempt's tracking note written
    by `write_tracking_ref`): the note names the run's store; an id the store lacks is taken from it."""
    found: list[tuple[str, str | None]] = []
    for run_id, ref in pairs:
        uri: str | None = None
        try:
            note = json.loads(ref.read_text())
            run_id = run_id or str(note.get("run_id") or "") or None
            uri = str(note.get("tracking_uri") or "") or None
        except (OSError, ValueError, AttributeError):
            pass
        if run_id:
            found.append((run_id, uri))
    return found


def note(log: Path, message: str) -> None:
    """One line in the run's supervisor.log from a short tracking process (never raises: a note is best effort)."""
    try:
        with open(log, "a") as out:
            out.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} [air] tracking: {message}\n")
    except OSError:
        pass


def _end(status: str, runs: list[tuple[str, str]]) -> int:
    from mlflow import MlflowClient

    failed = 0
    for run_id, uri in runs:
        try:
            client = MlflowClient(uri)
            current = client.get_run(run_id).info.status
            if current in _OPEN:
                client.set_terminated(run_id, status)
                print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} [air] tracking: MLflow run {run_id} was {current}; "
                      f"ended {status} (its supervisor died)", flush=True)
        except Exception as exc:  # one line per run that could not be ended; the others still are
            failed += 1
            print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} [air] tracking: could not end MLflow run {run_id}: "
                  f"{exc}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    tracking_client_only()
    _job = json.loads(sys.argv[1])
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "3")  # a server that is away: give up in seconds
    sys.exit(_end(str(_job["status"]), [(str(r), str(u)) for r, u in _job["runs"]]))
