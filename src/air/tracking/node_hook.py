"""How a workload node's Python processes join the attempt's MLflow run, which may not exist yet.

The supervisor creates the attempt's MLflow run in the background (an `import mlflow` costs 2-3 s of CPU,
10+ s under load) while the nodes already run. MLflow does not let a client choose a run id, so a node
learns it when it exists: every Python process of the node imports a `sitecustomize` that air writes
into the attempt's folder (first on PYTHONPATH). It copies the run's variables (MLFLOW_RUN_ID,
MLFLOW_EXPERIMENT_ID) from the attempt's run-variables file into `os.environ` at once when it exists;
otherwise it holds the first real `import mlflow` (the module's execution, not a `find_spec` look)
until the file appears, so the user's plain `mlflow.log_metric` lands in the attempt's run. A process
that never imports MLflow never waits. The environment's own `sitecustomize`, if any, still runs.

The hook is plain Python with no air import: a node may run an interpreter that cannot import air.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from air.files import atomic_write_text

#: How long a node's `import mlflow` waits for the attempt's run before going on without it.
HOOK_WAIT_S = 120.0

_HOOK = '''"""Written by air (air/tracking/node_hook.py): MLflow's run for this node's processes, once it exists."""
import os
import sys


def _air_mlflow_hook():
    import importlib.abc
    import json
    import time

    here = os.path.dirname(os.path.abspath(__file__))
    env_file = ENV_FILE

    def load():
        try:
            with open(env_file, encoding="utf-8") as fh:
                values = json.load(fh)
        except (OSError, ValueError):
            return False
        for key, value in values.items():
            os.environ.setdefault(key, str(value))
        return True

    class Loader(importlib.abc.Loader):
        def __init__(self, inner):
            self.inner = inner

        def create_module(self, spec):
            return self.inner.create_module(spec)

        def exec_module(self, module):
            deadline = time.monotonic() + WAIT_S
            while not load() and time.monotonic() < deadline:
                time.sleep(0.05)
            if not load():
                sys.stderr.write(f"[air] the attempt's MLflow run was not made within {WAIT_S:g} s; "
                                 "MLflow goes on without it\\n")
            try:
                sys.meta_path.remove(gate)
            except ValueError:
                pass
            module.__loader__ = self.inner
            if getattr(module, "__spec__", None) is not None:
                module.__spec__.loader = self.inner
            self.inner.exec_module(module)

    class Gate(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "mlflow":
                return None
            for finder in list(sys.meta_path):
                find = getattr(finder, "find_spec", None)
                if finder is self or find is None:
                    continue
                spec = find(name, path, target)
                if spec is not None:
                    if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                        spec.loader = Loader(spec.loader)
                    return spec
            return None

    gate = Gate()
    if "mlflow" not in sys.modules and not load() and os.path.isdir(os.path.dirname(env_file)):
        sys.meta_path.insert(0, gate)
    # The environment's own sitecustomize, as if this one were not here.
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    mine = sys.modules.pop("sitecustomize", None)
    try:
        import sitecustomize  # noqa: F401
    except ImportError as exc:
        if exc.name != "sitecustomize":
            raise
        if mine is not None:
            sys.modules["sitecustomize"] = mine


WAIT_S = @WAIT_S@
ENV_FILE = @ENV_FILE@
_air_mlflow_hook()
'''


def write_hook(folder: Path, env_file: Path, wait_s: float = HOOK_WAIT_S) -> Path:
    """Write the hook into `folder` (its `sitecustomize.py`); put `folder` first on the nodes' PYTHONPATH.
    It reads the run's variables from `env_file` (see `write_env`)."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    source = _HOOK.replace("@WAIT_S@", repr(float(wait_s))).replace("@ENV_FILE@", repr(str(env_file)))
    atomic_write_text(folder / "sitecustomize.py", source)
    return folder


def write_env(path: Path, values: Mapping[str, str]) -> None:
    """The run's variables for the hook (`{}`: no run; hooks stop waiting and go on without one)."""
    atomic_write_text(path, json.dumps(dict(values)))


def prepend_pythonpath(env: dict[str, str], folder: str) -> dict[str, str]:
    """`env` with `folder` first on PYTHONPATH (the node's own entries kept after it)."""
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != folder]
    env["PYTHONPATH"] = os.pathsep.join([folder, *rest])
    return env
