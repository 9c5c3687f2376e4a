"""Ranks get their MLflow run only when they use MLflow, and nobody waits for it otherwise.

Creating the call's MLflow run costs an `import mlflow` (1–2 s of CPU) and, on a fresh store, its
schema set-up: on the hot path of every call, and competing with the ranks' own start-up. So the
run is made on demand: the first time a rank imports mlflow (an import hook), it asks the caller for
the run (a request file) and waits for its variables (MLFLOW_RUN_ID, MLFLOW_TRACKING_URI, …); a
background thread then copies them into the rank's environment, so subprocesses it starts later
inherit them. A call whose ranks never use MLflow is recorded after it ends (see tracked.py).
"""

from __future__ import annotations

import importlib.abc
import json
import os
import sys
import threading
import time
from pathlib import Path

#: How long a rank's `import mlflow` waits for the caller's run before going on without it.
GATE_TIMEOUT_S = 60.0


class _Variables:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.request = path.with_name("mlflow_request")
        self.ready = threading.Event()
        self._lock = threading.Lock()

    def load(self) -> bool:
        with self._lock:
            if self.ready.is_set():
                return True
            try:
                values = json.loads(self.path.read_text())
            except (FileNotFoundError, ValueError):
                return False
            for key, value in values.items():
                os.environ.setdefault(key, str(value))
            self.ready.set()
            return True

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.load() and time.monotonic() < deadline:
            time.sleep(0.02)


class _MlflowImportGate(importlib.abc.MetaPathFinder):
    """Holds the first `import mlflow` until the call's MLflow variables are in the environment."""

    def __init__(self, variables: _Variables) -> None:
        self.variables = variables

    def find_spec(self, fullname: str, path: object, target: object = None) -> None:
        if fullname == "mlflow" or fullname.startswith("mlflow."):
            try:
                self.variables.request.touch()
            except OSError:
                pass
            self.variables.wait(GATE_TIMEOUT_S)
            try:
                sys.meta_path.remove(self)
            except ValueError:
                pass
        return None  # the normal finders do the import


def install(path: str | None) -> None:
    """Called by the rank entry point before the user's function runs."""
    if not path:
        return
    variables = _Variables(Path(path))
    if variables.load():
        return
    sys.meta_path.insert(0, _MlflowImportGate(variables))

    def poll() -> None:  # the run may also exist because another rank asked for it
        while not variables.load():
            time.sleep(0.1)

    threading.Thread(target=poll, name="air-mlflow-env", daemon=True).start()
