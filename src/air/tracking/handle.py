"""One MLflow run that air owns: an attempt of a workload, or one `@distributed` call.

The handle is plain data (run id, experiment id, URI) plus a `warn` callback, so the supervisor can keep
it in its run store and rebuild it after a restart with `TrackingHandle(run_id, experiment_id, uri)`.
Every method swallows tracking failures into `warn`: MLflow trouble never decides whether training runs.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from air.files import atomic_write_text
from air.tracking.params import clean_tags
from air.tracking.store import (
    HTTP_ARTIFACT_TIMEOUT_S,
    Warn,
    client,
    default_warn,
    http_limits,
    is_http,
    short_message,
)

#: MLflow's terminal run statuses that air sets.
EndStatus = Literal["FINISHED", "FAILED", "KILLED"]
END_STATUSES: tuple[str, ...] = ("FINISHED", "FAILED", "KILLED")

#: After this many failed tracking calls in a row the handle stops trying (one last warning), so a
#: server that died mid-run costs a bounded time at the end of the attempt, not one timeout per node.
MAX_CONSECUTIVE_FAILURES = 3

#: Tag holding air's reason when it ends a run as FAILED or KILLED.
REASON_TAG = "air.termination_reason"


@dataclass
class TrackingHandle:
    """The MLflow run of one attempt or call; hand `env()` to every node or rank."""

    run_id: str
    experiment_id: str
    tracking_uri: str
    warn: Warn = field(default=default_warn, repr=False, compare=False)
    _failures: int = field(default=0, init=False, repr=False, compare=False)

    def env(self) -> dict[str, str]:
        """Variables that make plain `mlflow.log_metric(...)` in user code land in this run."""
        return {
            "MLFLOW_RUN_ID": self.run_id,
            "MLFLOW_TRACKING_URI": self.tracking_uri,
            "MLFLOW_EXPERIMENT_ID": self.experiment_id,
        }

    def url(self, base: str | None = None) -> str:
        """Link to this run in an MLflow UI: the tracking server itself, else `air ui`'s address."""
        from air.tracking.ui import run_url, ui_base_url

        if base is None:
            base = self.tracking_uri if is_http(self.tracking_uri) else ui_base_url(store=self.tracking_uri)
        return run_url(self.run_id, self.experiment_id, base=base)

    # ---- artifacts ---------------------------------------------------------------------------------

    def log_node_log(self, path: str | os.PathLike[str], attempt: int, node: int) -> bool:
        """Store one node's log as `logs/attempt_<a>/node_<n>.log` (the layout `air logs` uses)."""
        return self.log_artifact(path, f"logs/attempt_{attempt}", f"node_{node}.log")

    def log_rank_log(self, path: str | os.PathLike[str], rank: int) -> bool:
        """Store one rank's log of a `@distributed` call as `logs/rank_<r>.log`."""
        return self.log_artifact(path, "logs", f"rank_{rank}.log")

    def log_artifact(
        self, path: str | os.PathLike[str], artifact_dir: str | None = None, name: str | None = None
    ) -> bool:
        """Upload one file under `artifact_dir`, renamed to `name`; False (and a warning) on failure."""
        src = Path(path)
        if not src.is_file():
            self.warn(f"tracking: not storing {src} in MLflow: no such file")
            return False

        def upload() -> None:
            mlflow_client = client(self.tracking_uri)
            if name is None or name == src.name:
                mlflow_client.log_artifact(self.run_id, str(src), artifact_dir)
                return
            with tempfile.TemporaryDirectory(prefix="air-artifact-") as tmp:
                staged = Path(tmp) / name
                try:
                    staged.symlink_to(src.resolve())  # no copy of a large log; readers follow it
                except OSError:
                    import shutil

                    shutil.copyfile(src, staged)
                mlflow_client.log_artifact(self.run_id, str(staged), artifact_dir)

        target = f"{artifact_dir}/{name or src.name}" if artifact_dir else (name or src.name)
        return self._call(f"store {target} in MLflow run {self.run_id}", upload, HTTP_ARTIFACT_TIMEOUT_S)

    # ---- run metadata ------------------------------------------------------------------------------

    def set_tags(self, tags: Mapping[str, object]) -> bool:
        """Add or overwrite run tags (values stringified and cut to MLflow's limit)."""
        cleaned = clean_tags(tags, self.warn)
        if not cleaned:
            return True

        def log() -> None:
            from mlflow.entities import RunTag

            client(self.tracking_uri).log_batch(self.run_id, tags=[RunTag(k, v) for k, v in cleaned.items()])

        return self._call(f"tag MLflow run {self.run_id}", log)

    def end(self, status: EndStatus | str, reason: str | None = None) -> bool:
        """Set the run's final status, overriding whatever the user's code did (end_run, atexit).

        Call after every node or rank has exited, so no user process ends the run again afterwards.
        """
        if status not in END_STATUSES:
            self.warn(f"tracking: unknown MLflow end status {status!r}; recording FAILED")
            status = "FAILED"
        if reason and status != "FINISHED":
            self.set_tags({REASON_TAG: reason})

        def terminate() -> None:
            client(self.tracking_uri).set_terminated(self.run_id, str(status))

        return self._call(f"set MLflow run {self.run_id} to {status}", terminate)

    # ---- plumbing ----------------------------------------------------------------------------------

    def _call(self, what: str, func: Callable[[], object], timeout_s: int | None = None) -> bool:
        """Run one tracking step with short HTTP limits; failures become warnings, never errors."""
        if self._failures >= MAX_CONSECUTIVE_FAILURES:
            return False
        try:
            with http_limits(self.tracking_uri, timeout_s):
                func()
        except Exception as exc:
            self._failures += 1
            self.warn(f"tracking: could not {what}: {short_message(exc)}")
            if self._failures >= MAX_CONSECUTIVE_FAILURES:
                self.warn(
                    f"tracking: {self._failures} MLflow calls failed in a row; "
                    f"not trying again for run {self.run_id}"
                )
            return False
        self._failures = 0
        return True

    def __getstate__(self) -> dict[str, object]:
        """Pickle as plain data: a caller's `warn` (a bound logger, a lambda) need not pickle."""
        state = dict(self.__dict__)
        state["warn"] = default_warn
        return state


def write_tracking_ref(path: Path, handle: TrackingHandle) -> None:
    """Note which MLflow run an attempt logs to (atomically), so `air get run` can link to it later
    without asking MLflow; the caller owns the file's name (`RunPaths.tracking`)."""
    atomic_write_text(path, json.dumps({"run_id": handle.run_id, "experiment_id": handle.experiment_id,
                                        "tracking_uri": handle.tracking_uri}))
