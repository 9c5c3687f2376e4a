"""Ranks get their MLflow run only when they use MLflow, and nobody waits for it otherwise.

Creating the call's MLflow run costs an `import mlflow` (1–2 s of CPU) and, on a fresh store, its
schema set-up: on the hot path of every call, and competing with the ranks' own start-up. So the
run is made on demand: the first time a rank imports mlflow (an import hook), it asks the caller for
the run (a request file) and waits for its variables (MLFLOW_RUN_ID, MLFLOW_TRACKING_URI, …); a
background thread then copies them into the rank's environment, so subprocesses it starts later
inherit them. A call whose ranks never use MLflow is recorded after it ends (see tracked.py).

Only an import is use. transformers and accelerate call `importlib.util.find_spec("mlflow")` (and
`importlib.metadata`) to see whether MLflow is installed; that look must cost nothing. So the hook
answers a look with MLflow's real spec, its loader wrapped: the run is asked for, and waited on, only
when the import machinery executes the module (`exec_module`).
"""

from __future__ import annotations

import importlib.abc
import json
import os
import sys
import threading
import time
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType
from typing import Any

#: How long a rank's `import mlflow` waits for the caller's run before going on without it. The caller
#: always answers (with no variables when MLflow failed, after the client's own retries: ~2 min for an
#: unreachable server), and its `import mlflow` alone took 13 s on the loaded 2-core dev VM: a shorter
#: wait lost the call's tracking there, which is worse than the wait.
GATE_TIMEOUT_S = 180.0


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


class _GatedLoader(importlib.abc.Loader):
    """MLflow's own loader, run only after the call's MLflow variables are in the environment."""

    def __init__(self, loader: importlib.abc.Loader, gate: _MlflowImportGate) -> None:
        self.loader = loader
        self.gate = gate

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.gate.open()
        spec = module.__spec__
        if spec is not None:  # the module looks as if imported without the gate (importlib.resources reads it)
            spec.loader = self.loader
        module.__loader__ = self.loader
        self.loader.exec_module(module)

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, is_package, get_code, …
        return getattr(self.loader, name)


class _MlflowImportGate(importlib.abc.MetaPathFinder):
    """Holds the first `import mlflow` until the call's MLflow variables are in the environment; a
    `find_spec` that does not import is answered at once."""

    def __init__(self, variables: _Variables) -> None:
        self.variables = variables
        self._opened = False

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname != "mlflow" or self._opened:
            return None  # mlflow's submodules are imported after mlflow itself: the gate has opened
        for finder in list(sys.meta_path):  # a copy: another thread's import may open (remove) the gate
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _GatedLoader(spec.loader, self)
                return spec
        return None

    def ask(self) -> None:
        """Ask the caller for the run (it makes it once, whoever asks), unless it is known already."""
        if self.variables.ready.is_set():
            return
        try:
            self.variables.request.touch()
        except OSError:
            pass

    def open(self) -> None:
        """MLflow is being used: ask the caller for the run and wait for its variables, once."""
        if self._opened:
            return
        self._opened = True
        self.ask()
        self.variables.wait(GATE_TIMEOUT_S)
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass


#: This rank's gate while the call's run is not yet in its environment (None: no gate, or opened).
_gate: _MlflowImportGate | None = None


def install(path: str | None) -> None:
    """Called by the rank entry point before the user's function runs."""
    global _gate
    if not path:
        return
    variables = _Variables(Path(path))
    if variables.load():
        return
    _gate = _MlflowImportGate(variables)
    sys.meta_path.insert(0, _gate)

    def poll() -> None:  # the run may also exist because another rank asked for it
        while not variables.load():
            time.sleep(0.1)

    threading.Thread(target=poll, name="air-mlflow-env", daemon=True).start()


def use_mlflow(wait: bool = True) -> None:
    """For code of air's that logs to the call's run without this rank importing mlflow first (ray_launch:
    Ray Train's reports and Ray's metrics are logged from other processes): ask for the run now and, with
    `wait`, wait until its variables (MLFLOW_RUN_ID, …) are in the environment. A no-op outside a lazily
    tracked call (a workload's node has them from the start; tracking off answers at once with none)."""
    gate = _gate
    if gate is None or gate._opened:
        return
    if wait:
        gate.open()
    else:
        gate.ask()
