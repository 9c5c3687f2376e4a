"""Ranks learn their MLflow run without waiting for it at start-up.

Creating the call's MLflow run costs the caller an `import mlflow` (1–2 s) and, on a fresh store, its
schema set-up. The caller does that in a background thread while the ranks start, and writes the
run's variables (MLFLOW_RUN_ID, MLFLOW_TRACKING_URI, …) to a file. A rank waits for that file only
when its code first imports mlflow (an import hook), and a background thread copies the variables
into the rank's environment as soon as they exist, so subprocesses it starts later inherit them.
Code that never uses MLflow never waits.
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

    def poll() -> None:
        variables.wait(GATE_TIMEOUT_S)

    threading.Thread(target=poll, name="air-mlflow-env", daemon=True).start()
