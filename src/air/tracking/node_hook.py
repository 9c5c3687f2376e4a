"""How a workload node's Python processes join the attempt's MLflow run, which may not exist yet.

The supervisor creates the attempt's MLflow run in the background (an `import mlflow` costs 2-3 s of CPU,
10+ s under load) while the nodes already run. MLflow does not let a client choose a run id, so a node
learns it when it exists: every Python process of the node imports a `sitecustomize` that air writes
into the attempt's folder (first on PYTHONPATH). It copies the run's variables (MLFLOW_RUN_ID,
MLFLOW_EXPERIMENT_ID) from the attempt's run-variables file into `os.environ` at once when it exists;
otherwise it holds the first real `import mlflow` (the module's execution, not a `find_spec` look)
until the file appears, so the user's plain `mlflow.log_metric` lands in the attempt's run; a read of
`os.environ["MLFLOW_RUN_ID"]` before that (Lightning's `MLFlowLogger(run_id=...)`) waits the same way. A
process that does neither never waits. The environment's own `sitecustomize`, if any, still runs. A node
command that names MLFLOW_RUN_ID in bash starts through `prelude_of(folder)`, which waits and exports it.

The hook is plain Python with no air import: a node may run an interpreter that cannot import air.

Nodes walled in by a sandbox (`walled=True`) see the hook's folder alone, read-only, bound into their view:
their run-variables file is a copy inside it (`node_env_of`), and they have no spool (nothing a node writes
is ever read by the supervisor's account): a process whose run is not made in time logs through the door
without a run id, into an MLflow run of its own that the door ties to the same air run.
"""

from __future__ import annotations

import json
import math
import os
import shlex
from collections.abc import Mapping
from pathlib import Path

from air.files import atomic_write_text

#: How long a node's `import mlflow` waits for the attempt's run before going on without it (into a local
#: store under the hook's folder, copied into the run once it is made: never a stray run on the server).
HOOK_WAIT_S = 120.0
#: Longest a node process's exit waits for MLflow's queue to be sent (MLflow's own retries, ~10 minutes
#: with the nodes' settings, end sooner: this only bounds a client stuck past them).
FLUSH_S = 660.0

_HOOK = '''"""Written by air (air/tracking/node_hook.py): MLflow's run for this node's processes, once it exists."""
import os
import sys


def _air_mlflow_hook():
    import _thread
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
        # `{}`: the supervisor gave up on the run; or a parent process already logs locally (its children
        # inherit its local store, not the tracking URI they would need for the run id).
        if not values.get("MLFLOW_RUN_ID") or (
                SPOOL and os.environ.get("MLFLOW_TRACKING_URI", "").startswith("file://" + SPOOL)):
            spool()
            return True
        for key, value in values.items():
            os.environ.setdefault(key, str(value))
        return True

    def spool():
        # No run to log into: never MLflow's own stray run on the server. This process's MLflow writes a
        # local store under the hook's folder instead; the supervisor copies it into the attempt's run once
        # that is made (tracking/backfill.py: copy_spool).
        if os.environ.get("MLFLOW_RUN_ID") or not SPOOL:  # (walled in: no spool, see node_hook.py)
            return
        os.environ["MLFLOW_TRACKING_URI"] = "file://" + os.path.join(SPOOL, str(os.getpid()))
        os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
        os.environ.pop("MLFLOW_EXPERIMENT_ID", None)
        os.environ.pop("MLFLOW_EXPERIMENT_NAME", None)

    state = {"done": False}
    lock = _thread.RLock()

    def await_run(say=None):
        # Once per process: wait (bounded) for the run's variables, or go on without a run.
        with lock:
            if state["done"]:
                return
            state["done"] = True  # (first: load() below reads os.environ, which must not wait again)
            if not load() and say:
                sys.stderr.write(say)
            deadline = time.monotonic() + WAIT_S
            while not load() and time.monotonic() < deadline:
                time.sleep(0.05)
            if not load():
                spool()
                sys.stderr.write(f"[air] the attempt's MLflow run was not made within {WAIT_S:g} s; this "
                                 + ("process's MLflow logs locally, copied into the run once it is made\\n" if SPOOL
                                    else "process's MLflow logs into a run of its own\\n"))

    class Environ(type(os.environ)):
        # Code that reads the run's id before any `import mlflow` (Lightning's
        # `MLFlowLogger(run_id=os.environ.get("MLFLOW_RUN_ID"))`, transformers' callback) gets it too: that
        # read, and only that one, waits for the run. Other variables, and listing os.environ, never wait.
        def __getitem__(self, key):
            if key in RUN_KEYS and not state["done"]:
                await_run("[air] waiting for its MLflow run (this process reads " + key + ")\\n")
            return super().__getitem__(key)

    class Loader(importlib.abc.Loader):
        def __init__(self, inner):
            self.inner = inner

        def create_module(self, spec):
            return self.inner.create_module(spec)

        def exec_module(self, module):
            await_run()
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
        try:
            os.environ.__class__ = Environ  # (the same object: a module's `from os import environ` sees it too)
        except TypeError:
            pass
    else:
        state["done"] = True
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


def _air_async_logging():
    # Through an http(s) tracking server, `mlflow.log_metric` & co. queue and return at once (MLflow's
    # async logging), so a server that is away (restarting) never blocks training; the queue retries
    # until it is back. MLflow drains its queue in an `atexit` callback, but Python runs that only after
    # `concurrent.futures` has shut its thread pools (a threading-atexit hook), so a batch still queued
    # then is dropped ("cannot schedule new futures after interpreter shutdown"): a process that logs
    # and exits at once lost its metrics. This flush is registered after concurrent.futures' own hook,
    # and those run in reverse order: it runs first, while the pools still take work.
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if not uri.startswith(("http://", "https://")):
        return
    import threading

    register = getattr(threading, "_register_atexit", None)
    if register is None:
        return
    os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "true")
    if os.environ["MLFLOW_ENABLE_ASYNC_LOGGING"].strip().lower() not in ("true", "1"):
        return
    # Queued values merged into one request per BUFFER_S (up to MLflow's 1000 per batch), not one request
    # per `log_metric`: after an outage a node's queue drains in a few requests, not thousands.
    os.environ.setdefault("MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS", BUFFER_S)
    import concurrent.futures.thread  # noqa: F401  (its exit hook first, so this one runs before it)

    def send():
        mlflow = sys.modules.get("mlflow")
        flush_all = getattr(mlflow, "flush_async_logging", None)
        if flush_all is None:
            return
        try:
            flush_all()
        except Exception as exc:
            sys.stderr.write(f"[air] MLflow's queued metrics could not be sent at exit: {exc}\\n")

    def flush():
        # Bounded: a node whose tracking server never comes back still exits (after MLflow's own retries).
        sender = threading.Thread(target=send, name="air-mlflow-flush", daemon=True)
        sender.start()
        sender.join(FLUSH_S)
        if sender.is_alive():
            sys.stderr.write(f"[air] MLflow's queued metrics were not sent within {FLUSH_S:g} s of the exit; "
                             "the process exits without them\\n")

    try:
        register(flush)
    except RuntimeError:
        pass


WAIT_S = @WAIT_S@
ENV_FILE = @ENV_FILE@
SPOOL = @SPOOL@
FLUSH_S = @FLUSH_S@
BUFFER_S = "2"
RUN_KEYS = ("MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_ID")
_air_async_logging()
_air_mlflow_hook()
'''


#: A node command that reads `$MLFLOW_RUN_ID` in bash (`echo "run $MLFLOW_RUN_ID"`) starts through this: it waits
#: (bounded, said in the node's log) for the attempt's run's variables and exports them, then runs the command
#: under `bash -euo pipefail` as always. Commands that do not mention MLFLOW_RUN_ID start at once without it.
_PRELUDE = """# Written by air (air/tracking/node_hook.py): MLFLOW_RUN_ID for a node command that reads it.
if [ -z "${MLFLOW_RUN_ID:-}" ]; then
  _air_file=@ENV_FILE@
  if [ ! -s "$_air_file" ]; then
    echo "[air] waiting for its MLflow run (the command reads MLFLOW_RUN_ID)" >&2
    _air_end=$((SECONDS + @WAIT_S@))
    while [ ! -s "$_air_file" ] && [ "$SECONDS" -lt "$_air_end" ]; do sleep 0.1; done
  fi
  _air_id=$(sed -n 's/.*"MLFLOW_RUN_ID": *"\\([^"]*\\)".*/\\1/p' "$_air_file" 2>/dev/null || true)
  _air_exp=$(sed -n 's/.*"MLFLOW_EXPERIMENT_ID": *"\\([^"]*\\)".*/\\1/p' "$_air_file" 2>/dev/null || true)
  if [ -n "$_air_id" ]; then
    export MLFLOW_RUN_ID="$_air_id"
    if [ -n "$_air_exp" ]; then export MLFLOW_EXPERIMENT_ID="$_air_exp"; fi
  else
    echo "[air] the attempt's MLflow run was not made within @WAIT_S@ s; MLFLOW_RUN_ID is not set" >&2
  fi
  unset _air_file _air_end _air_id _air_exp
fi
exec bash -euo pipefail "$@"
"""


def reads_run_id(command: str) -> bool:
    """Whether a node command reads MLFLOW_RUN_ID itself (then it starts once the run exists: `prelude_of`)."""
    return "MLFLOW_RUN_ID" in command


def prelude_of(folder: Path) -> Path:
    """The bash prelude (in the hook's folder, which walled nodes see too) of commands that read MLFLOW_RUN_ID:
    `bash PRELUDE COMMAND_FILE` waits for the run, exports its id and runs `bash -euo pipefail COMMAND_FILE`."""
    return folder / "mlflow_run_id.sh"


def write_hook(folder: Path, env_file: Path, wait_s: float = HOOK_WAIT_S, *, walled: bool = False) -> Path:
    """Write the hook into `folder` (its `sitecustomize.py`); put `folder` first on the nodes' PYTHONPATH.
    It reads the run's variables from `env_file` (see `write_env`). `walled`: for nodes in a sandbox, which
    see only `folder` (bound read-only, so it is made readable by any account: it holds the hook's code and,
    in `node_env_of(folder)`, which it reads instead of `env_file`, the run's id, nothing secret); no spool."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    if walled:
        os.chmod(folder, 0o755)  # (its parents stay the server's alone: only the view shows it to the run)
    spool = "" if walled else str(spool_of(folder))
    source = (_HOOK.replace("@WAIT_S@", repr(float(wait_s)))
              .replace("@ENV_FILE@", repr(str(node_env_of(folder) if walled else env_file)))
              .replace("@SPOOL@", repr(spool)).replace("@FLUSH_S@", repr(float(FLUSH_S))))
    atomic_write_text(folder / "sitecustomize.py", source)
    atomic_write_text(prelude_of(folder), _PRELUDE.replace("@WAIT_S@", str(max(1, math.ceil(wait_s))))
                      .replace("@ENV_FILE@", shlex.quote(str(node_env_of(folder) if walled else env_file))))
    return folder


def node_env_of(folder: Path) -> Path:
    """The copy of the run's variables that walled-in nodes read (inside the hook's folder, the one thing
    of the attempt's folder their view shows)."""
    return folder / "mlflow_env.json"


def spool_of(folder: Path) -> Path:
    """The local MLflow stores (one per process) of node processes that gave up waiting for the run."""
    return folder / "spool"


def write_env(path: Path, values: Mapping[str, str]) -> None:
    """The run's variables for the hook (`{}`: no run; hooks stop waiting and go on without one)."""
    atomic_write_text(path, json.dumps(dict(values)))


def prepend_pythonpath(env: dict[str, str], folder: str) -> dict[str, str]:
    """`env` with `folder` first on PYTHONPATH (the node's own entries kept after it)."""
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != folder]
    env["PYTHONPATH"] = os.pathsep.join([folder, *rest])
    return env
