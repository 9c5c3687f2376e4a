"""`air ui`: MLflow's own UI over the embedded store, where it runs, and links into it.

air does not ship a UI: the embedded store is a normal MLflow SQLite store, so `mlflow ui` shows it. The
UI server comes with the full `mlflow` distribution (the `ui` extra); air itself needs only
`mlflow-skinny`. A running `air ui` notes its addresses (MLflow's UI and air's pages) in
`$AIR_HOME/ui.json` (this module owns that file), so links printed by `air get run` and by calls point
at the ports it really listens on. An
attempt's `tracking.json` (named by `RunPaths.tracking`, written by handle.py) is read into a link here.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from air.errors import UserInputError
from air.files import atomic_write_text
from air.home import AirHome
from air.tracking.store import is_http, tracking_uri

DEFAULT_UI_HOST = "127.0.0.1"
DEFAULT_UI_PORT = 5000
DEFAULT_UI_BASE = f"http://{DEFAULT_UI_HOST}:{DEFAULT_UI_PORT}"

#: Distribution name of air, for the install hint (pyproject's `name`).
DISTRIBUTION = "air-runtime"
#: Extra that brings MLflow's UI server.
UI_EXTRA = "ui"


def ui_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` as `mlflow ui` runs in it (`air ui`, `air server`'s MLflow): MLflow's job runner off unless
    MLFLOW_SERVER_ENABLE_JOB_EXECUTION says otherwise. It serves MLflow's GenAI jobs, which training runs
    never use, with 8 more processes: 10 processes and 2.26 GB resident instead of 2 and 0.5 GB here."""
    return {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **environ}


def ui_base_url(host: str | None = None, port: int | None = None, store: str | None = None) -> str:
    """Where the UI for `store` (default: the current tracking URI) lives.

    The tracking server itself for an http(s) store; else the given host/port; else the address of the
    `air ui` running for that store; else `air ui`'s default address (where it will be once started).
    """
    uri = tracking_uri() if store is None else store
    if is_http(uri):
        return uri.rstrip("/")
    if host is not None or port is not None:
        return f"http://{host or DEFAULT_UI_HOST}:{port or DEFAULT_UI_PORT}"
    running = running_ui(uri)
    return running.base_url if running is not None else DEFAULT_UI_BASE


def run_url(run_id: str, experiment_id: str, base: str | None = None) -> str:
    """Link to one run in an MLflow UI (the single-page app's route); `base` defaults to `ui_base_url()`."""
    base = ui_base_url() if base is None else base
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


def tracking_ref_url(path: Path) -> str | None:
    """A link into the MLflow UI for the run noted in `path` (by `write_tracking_ref`); None when there is
    no such note or it cannot be read. A non-SQLite store is its own UI; the embedded one links to the
    port a running `air ui` for it listens on, else `air ui`'s default address."""
    try:
        info = json.loads(path.read_text())
        uri = info.get("tracking_uri", "")
        if not uri.startswith("sqlite"):
            return f"{uri.rstrip('/')}/#/experiments/{info['experiment_id']}/runs/{info['run_id']}"
        return run_url(info["run_id"], info["experiment_id"], base=ui_base_url(store=uri))
    except Exception:  # a missing or broken note only means no link
        return None


# ---- is the UI server installed? ---------------------------------------------------------------------


def ui_install_hint() -> str:
    """The command that installs MLflow's UI server next to air."""
    return f"pip install '{DISTRIBUTION}[{UI_EXTRA}]'"


def ui_server_installed() -> bool:
    """Whether MLflow's UI server can run here: the full `mlflow` distribution (not only mlflow-skinny).

    mlflow-skinny ships the `mlflow` package and CLI too, but `mlflow ui` then fails on a missing Flask;
    the distribution is what the `ui` extra installs, so it is what is checked.
    """
    from importlib import metadata

    try:
        metadata.distribution("mlflow")
    except metadata.PackageNotFoundError:
        return False
    return True


def require_ui_server() -> None:
    """A user error naming the extra to install when MLflow's UI server is missing."""
    if not ui_server_installed():
        raise UserInputError(
            "`air ui` needs MLflow's UI server, which this install does not have (air depends on "
            "mlflow-skinny only, to stay small).",
            hint=f"Install it with: {ui_install_hint()}  (or `make setup` in air's checkout), "
            "then run `air ui` again.",
        )


# ---- where a running `air ui` listens ----------------------------------------------------------------


@dataclass(frozen=True)
class RunningUI:
    """One `air ui` process and what it serves."""

    pid: int
    create_time: float
    host: str
    port: int
    store: str
    #: Port of air's pages (None: an entry written before `air ui` served them).
    web_port: int | None = None

    def _url(self, port: int) -> str:
        host = DEFAULT_UI_HOST if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{'[' + host + ']' if ':' in host else host}:{port}"

    @property
    def base_url(self) -> str:
        """MLflow's UI."""
        return self._url(self.port)

    @property
    def pages_url(self) -> str | None:
        """air's pages."""
        return self._url(self.web_port) if self.web_port else None

    def alive(self) -> bool:
        """The same process (PID and start time) is still running: a recycled PID is not it."""
        import psutil

        try:
            return abs(psutil.Process(self.pid).create_time() - self.create_time) < 0.01
        except psutil.Error:
            return False


def ui_file() -> Path:
    """`ui.json` under AIR_HOME: the running `air ui` processes (written only by this module)."""
    return AirHome().ui


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    with open(AirHome().ui_lock, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _read() -> list[RunningUI]:
    try:
        entries = json.loads(ui_file().read_text()).get("uis", [])
        return [RunningUI(**e) for e in entries]
    except (OSError, ValueError, TypeError, AttributeError):
        return []


def _write(uis: list[RunningUI]) -> None:
    path = ui_file()
    if not uis:
        path.unlink(missing_ok=True)
        return
    atomic_write_text(path, json.dumps({"uis": [asdict(u) for u in uis]}, indent=1))


def record_ui(host: str, port: int, store: str, *, web_port: int | None = None) -> RunningUI:
    """Note this process as a running UI (MLflow's on `port`, 0: none; air's pages on `web_port`); dead
    entries are dropped on the way."""
    import psutil

    me = RunningUI(os.getpid(), psutil.Process().create_time(), host, port, store, web_port)
    with _locked():
        _write([u for u in _read() if u.alive() and u.pid != me.pid] + [me])
    return me


def forget_ui(pid: int | None = None) -> None:
    """Remove this process's entry (and dead ones); the file goes when no UI is left."""
    pid = os.getpid() if pid is None else pid
    with _locked():
        _write([u for u in _read() if u.alive() and u.pid != pid])


def _same_store(a: str, b: str) -> bool:
    if a == b:
        return True
    if a.startswith("sqlite:///") and b.startswith("sqlite:///"):
        try:
            return (
                Path(a.removeprefix("sqlite:///")).resolve() == Path(b.removeprefix("sqlite:///")).resolve()
            )
        except OSError:
            return False
    return False


def running_ui(store: str | None = None) -> RunningUI | None:
    """The newest live `air ui` of this AIR_HOME serving `store` (default: the current tracking URI)."""
    store = tracking_uri() if store is None else store
    live = [u for u in _read() if _same_store(u.store, store) and u.port and u.alive()]
    return live[-1] if live else None


def pages_base_url(store: str | None = None) -> str | None:
    """Where a running `air ui` of this AIR_HOME serves air's pages for `store`; None when none does."""
    store = tracking_uri() if store is None else store
    live = [u for u in _read() if _same_store(u.store, store) and u.web_port and u.alive()]
    return live[-1].pages_url if live else None


# ---- an MLflow server that is still starting ---------------------------------------------------------

#: Longest a supervisor waits for its air server's MLflow to finish starting before it runs untracked.
TRACKING_START_WAIT_S = 240.0


def wait_for_tracking_server(timeout_s: float = TRACKING_START_WAIT_S) -> bool:
    """Wait until the tracking server (MLFLOW_TRACKING_URI, over http) answers its health check; True once
    it does, False when it says it failed or `timeout_s` passes. An air server serves before its MLflow is
    up (its door answers 503 "MLflow is starting"), so a supervisor it starts in that minute waits here
    instead of running its first attempt untracked. True at once without an http tracking URI."""
    import time
    import urllib.error
    import urllib.request

    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if not is_http(uri):
        return True
    request = urllib.request.Request(uri.rstrip("/") + "/health")
    if os.environ.get("MLFLOW_TRACKING_TOKEN"):
        request.add_header("Authorization", f"Bearer {os.environ['MLFLOW_TRACKING_TOKEN']}")
    context = None
    if uri.startswith("https"):
        import ssl

        if os.environ.get("MLFLOW_TRACKING_SERVER_CERT_PATH"):
            context = ssl.create_default_context(cafile=os.environ["MLFLOW_TRACKING_SERVER_CERT_PATH"])
        elif os.environ.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() == "true":
            context = ssl._create_unverified_context()  # what MLflow's own switch means
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(request, timeout=10, context=context) as answer:  # http(s) only
                return bool(answer.status == 200)
        except urllib.error.HTTPError as exc:
            if exc.code != 503 or b"starting" not in exc.read(4096):
                return exc.code < 500  # failed to start, or a server without this check: try as before
        except OSError:
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(1.0)
