"""Running `air server`: uvicorn in the foreground until SIGTERM/SIGINT.

Run supervisors are their own detached processes (air.runs.supervisor): stopping or killing the server
leaves them running, and a server started again serves them from the store. On the way out the server
ends only what it owns: open log streams (so shutdown never waits on a follower) and its MLflow server.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, TextIO

from air.errors import UserInputError
from air.processes import PROCESS_KINDS

if TYPE_CHECKING:
    import uvicorn

    from air.server.mlflow_server import MLflowState
    from air.store.run_store import RunStore

#: `serve`'s `on_ready(url, mlflow_uri, mlflow_state)`, called once the port is open.
OnReady = Callable[[str, str, "MLflowState | None"], None]

_log = logging.getLogger("air.server")


def _server(config: uvicorn.Config, stopping: threading.Event) -> uvicorn.Server:
    """uvicorn.Server that also tells the app's open streams to end when a stop signal comes."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            stopping.set()
            super().handle_exit(sig, frame)
            self._captured_signals.clear()  # a stop we asked for is a clean exit (0), not death by signal

    return Server(config)


#: The modules of the detached processes this server starts and never waits for.
_DETACHED = tuple(PROCESS_KINDS[k].module for k in ("supervisor", "call_driver", "backfill"))


def _reap_detached(known: set[int]) -> None:
    """Collect ended supervisors and call drivers (only those, seen alive earlier in `known`: a child
    someone else waits for is theirs to collect). One missed here is collected by the next spawn."""
    import psutil

    for child in psutil.Process().children():
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                if child.pid in known:
                    os.waitpid(child.pid, os.WNOHANG)
                    known.discard(child.pid)
            elif any(module in child.cmdline() for module in _DETACHED):
                known.add(child.pid)
        except (psutil.Error, ChildProcessError):
            continue


def _housekeeping(store: RunStore, stopping: threading.Event, tracking_ready: Callable[[], bool] = lambda: True) -> None:
    """Collect the exit status of supervisors this server started (none lingers as a zombie), end runs
    whose supervisor died (what every local `air` command does, here without one being typed), and, once
    `tracking_ready()` (its MLflow answers) and then every BACKFILL_EVERY_S, make the MLflow runs of runs
    marked "tracking pending" (their supervisor gave up while MLflow was away: reconcile.backfill_pending)."""
    from air.runs.reconcile import BACKFILL_EVERY_S, backfill_pending, reconcile
    from air.views.follow import RECONCILE_EVERY_S

    known: set[int] = set()
    backfill_at = 0.0
    while not stopping.wait(RECONCILE_EVERY_S):
        _reap_detached(known)
        try:
            reconcile(store)
        except Exception as exc:  # a failed check is tried again at the next tick
            _log.warning("could not check run supervisors: %s", exc)
        if time.monotonic() >= backfill_at and tracking_ready():
            backfill_at = time.monotonic() + BACKFILL_EVERY_S
            try:
                backfill_pending(store)
            except Exception as exc:  # tried again at the next pass
                _log.warning("could not back-fill the MLflow runs of runs marked tracking pending: %s", exc)


def check_server_home() -> str:
    """The profile runs go to (this AIR_HOME's default); a `server` profile would send them in a circle.
    Its pools must exist on this machine (checked before serving, not at the first run)."""
    from air.config import load_config, resolve_profile

    config = load_config()
    profile = resolve_profile(None, config)
    if profile.backend == "server":
        raise UserInputError(f"The server's own default profile {profile.name!r} points at a server ({profile.url}).",
                             hint="Give the server an AIR_HOME whose default profile is local or ray.")
    if config.pools:
        from air.runs.queue import local_capacity

        if config.ray_pools != (profile.backend == "ray"):
            raise UserInputError(
                f"pools: the default profile {profile.name!r} is {profile.backend}, but the pools are of "
                + ("Ray nodes (ray_labels)." if config.ray_pools else "this machine's slots (slots)."),
                hint=f"Pools of a local profile name slots, of a ray profile ray_labels: fix {config.path}.")
        config.check_pools({kind: local_capacity(kind) or 0 for kind in ("GPU", "CPU")})
    return profile.name


def serve(host: str, port: int, *, mlflow: bool = False, tls_cert: Path | None = None,
          tls_key: Path | None = None, on_ready: OnReady | None = None, public: str | None = None,
          single_trust_domain: bool = False, on_mlflow: Callable[[MLflowState], None] | None = None,
          critical_users: frozenset[str] = frozenset()) -> None:
    """Serve until stopped (and, with `mlflow`, MLflow on a Unix socket behind the door at `/mlflow`,
    started beside the API, which does not wait for it). `public`: the server's address for nodes and
    links (default: the bind address). `on_ready(url, mlflow_uri, mlflow_state)` is called once the port is
    open; `on_mlflow(state)` once MLflow is ready or has failed. `single_trust_domain`: run every run as
    the server's own account, with no walls (air.server.isolation). `critical_users`: who besides admins
    may submit `compute.priority_class: CRITICAL` (it preempts BEST_EFFORT runs)."""
    from air.server.isolation import apply_isolation, choose_isolation
    from air.server.mlflow_server import (
        MLFLOW_PREFIX,
        mlflow_server,
        public_url,
        server_credential,
        supervisor_env,
    )
    from air.store.run_store import RunStore

    if (tls_cert is None) != (tls_key is None):
        raise UserInputError("--tls-cert and --tls-key go together.")
    check_server_home()
    isolation = choose_isolation(RunStore(), single_trust_domain=single_trust_domain)
    apply_isolation(isolation)  # before anything is started: supervisors and call drivers inherit it
    door = public_url(host, port, tls=tls_cert is not None, given=public) + MLFLOW_PREFIX
    credential = server_credential() if mlflow else ""
    supervisor = supervisor_env(host, port, credential=credential, tls_cert=tls_cert, tls_key=tls_key) if mlflow else {}
    _warnings_to_log()
    with mlflow_server(door=door, supervisor=supervisor, enabled=mlflow, on_change=on_mlflow) as (mlflow_socket, state):
        _serve(host, port, mlflow_socket=mlflow_socket, tls_cert=tls_cert, tls_key=tls_key, on_ready=on_ready,
               door=door if mlflow_socket else None, isolation=isolation, credential=credential,
               mlflow_state=state, critical_users=critical_users)


def _warnings_to_log() -> None:
    """Python warnings of the server's own libraries (deprecations...) go to its log (ServerPaths.log),
    not the terminal: what the terminal shows is air's."""
    import warnings

    from air.server.uploads import ServerPaths

    log = ServerPaths.here().log

    def to_log(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: TextIO | None = None,
               line: str | None = None) -> None:
        try:
            log.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            with open(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "a") as out:
                out.write(warnings.formatwarning(message, category, filename, lineno, line))
        except OSError:
            pass  # a warning is never worth failing the server for

    warnings.showwarning = to_log


def _serve(host: str, port: int, *, mlflow_socket: Path | None, tls_cert: Path | None, tls_key: Path | None,
           on_ready: OnReady | None, door: str | None = None, isolation: str = "", credential: str = "",
           mlflow_state: MLflowState | None = None, critical_users: frozenset[str] = frozenset()) -> None:
    import uvicorn

    from air.runs.reconcile import reconcile
    from air.server.app import create_app
    from air.store.run_store import RunStore
    from air.tracking.store import tracking_uri

    store = RunStore()
    store.schema_version()  # migrate (the tokens table) before the first request
    from air.server.isolation import secure_state

    secure_state()  # the store, secrets and run folders: the server's account's alone
    reconcile(store)  # runs whose supervisor died while no server ran end now, with a reason
    stopping = threading.Event()
    app = create_app(store=store, mlflow_uri=door if mlflow_socket else tracking_uri(), stopping=stopping)
    app.state.isolation = isolation  # GET /api/v1/health reports it
    app.state.critical_users = critical_users  # who may submit CRITICAL runs (besides admins)
    app.state.mlflow_state = mlflow_state  # and this (the door answers 503 until it is ready)
    if mlflow_socket and door:  # MLflow on its Unix socket: only the door at /mlflow reaches it
        from air.server.mlflow_door import mount_door

        mount_door(app, mlflow_socket, public=door, server_credential=credential)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=5, ssl_certfile=str(tls_cert) if tls_cert else None,
                            ssl_keyfile=str(tls_key) if tls_key else None)
    server = _server(config, stopping)
    threading.Thread(target=_housekeeping, args=(RunStore(), stopping, lambda: mlflow_state is None or
                                                 mlflow_state.state in ("ready", "off")),
                     name="air-server-housekeeping", daemon=True).start()
    from air.runs.admission import start_in_thread

    start_in_thread(RunStore, stopping)  # queued runs are rows: this one thread starts their supervisors in turn

    def announce() -> None:
        while not server.started and not stopping.is_set():
            time.sleep(0.05)
        if server.started and on_ready is not None:
            on_ready(f"{'https' if tls_cert else 'http'}://{host}:{port}", door or app.state.mlflow_uri, mlflow_state)

    threading.Thread(target=announce, name="air-server-ready", daemon=True).start()
    try:
        server.run()
    finally:
        stopping.set()
        _disconnect_ray()


def _disconnect_ray() -> None:
    """Leave a Ray cluster the server connected to (checking shapes), before the interpreter exits."""
    import sys

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
