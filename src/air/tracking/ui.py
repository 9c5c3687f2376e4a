"""`air ui`: MLflow's own UI over the embedded store, and links into it.

air does not ship a UI: the embedded store is a normal MLflow SQLite store, so `mlflow ui` shows it.
"""

from __future__ import annotations

import sys

from air.errors import UserInputError
from air.tracking.store import artifact_root, is_embedded, is_http, prepare_store, tracking_uri

DEFAULT_UI_HOST = "127.0.0.1"
DEFAULT_UI_PORT = 5000
DEFAULT_UI_BASE = f"http://{DEFAULT_UI_HOST}:{DEFAULT_UI_PORT}"


def ui_command(host: str = DEFAULT_UI_HOST, port: int = DEFAULT_UI_PORT) -> list[str]:
    """argv of `mlflow ui` for the current store (run with this interpreter, so the venv's mlflow).

    For the embedded store, new experiments made in the UI also keep artifacts under AIR_HOME, and the
    store is created first so the UI never starts on a missing file. An http(s) tracking URI already
    has a UI: that is a user error whose hint is the address to open.
    """
    uri = tracking_uri()
    if is_http(uri):
        raise UserInputError(
            f"MLFLOW_TRACKING_URI points at an MLflow server ({uri}); it serves its own UI.",
            hint=f"Open {uri} in a browser, or unset MLFLOW_TRACKING_URI to browse air's embedded store.",
        )
    argv = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri]
    if is_embedded(uri):
        try:
            prepare_store(uri)
        except Exception:  # noqa: BLE001 — `mlflow ui` reports a broken store better than we can
            pass
        argv += ["--default-artifact-root", artifact_root().as_uri()]
    return argv + ["--host", host, "--port", str(port)]


def ui_base_url(host: str = DEFAULT_UI_HOST, port: int = DEFAULT_UI_PORT) -> str:
    """Where the UI for the current store lives: the tracking server itself, else `air ui`'s address."""
    uri = tracking_uri()
    return uri.rstrip("/") if is_http(uri) else f"http://{host}:{port}"


def run_url(run_id: str, experiment_id: str, base: str = DEFAULT_UI_BASE) -> str:
    """Link to one run in an MLflow UI (the single-page app's route)."""
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


def experiment_url(experiment_id: str, base: str = DEFAULT_UI_BASE) -> str:
    """Link to one experiment's run list in an MLflow UI."""
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}"
