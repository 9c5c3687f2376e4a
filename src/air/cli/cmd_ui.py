"""`air ui`: air's own pages (runs, logs, queue, capacity) and MLflow's UI over the local stores, on localhost.

MLflow's UI keeps `--port` (the links `air get run` prints point there); air's pages listen on `--web-port`
(default: the next port), served by uvicorn on a thread of this process, so they end with it. With a
tracking server (MLFLOW_TRACKING_URI=http…), which has its own UI, only air's pages are served.

MLflow's server is a tree (its CLI, uvicorn, workers); it runs under a guard in its own session, so any
way `air ui` stops (Ctrl-C, SIGTERM, SIGHUP, or SIGKILL through the guard's pdeathsig) ends all of it and
frees the port. While it runs, its address is noted under AIR_HOME so links point at the real port.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import time
import uuid

import click

from air.cli.main import common
from air.cli.output import stderr
from air.errors import LaunchError, UserInputError
from air.settings import AIR_PROCESS_TAG


def _port_busy(host: str, port: int) -> OSError | None:
    """The error binding host:port gives now (as the server would bind it), or None when it is free."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return exc
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is free
        try:
            sock.bind(addr)
        except OSError as exc:
            return exc
    return None


def _free_port_near(host: str, port: int) -> int | None:
    for candidate in range(port + 1, min(port + 50, 65535) + 1):
        if _port_busy(host, candidate) is None:
            return candidate
    return None


def check_port(host: str, port: int, *, command: str = "air ui") -> None:
    """A busy port is an error that says so and how to pick another, before anything is started; the hint
    names `command`, the one whose --port to change (`air ui`, `air server start`)."""
    from air.tracking.ui import running_ui

    problem = _port_busy(host, port)
    if problem is None:
        return
    if isinstance(problem, socket.gaierror):
        raise LaunchError(
            f"Cannot listen on {host}:{port}: {problem}.",
            hint="Pass an address of this machine with --host (default 127.0.0.1).",
        )
    if problem.errno != errno.EADDRINUSE:
        raise LaunchError(
            f"Cannot listen on {host}:{port}: {problem.strerror or problem}.",
            hint=f"Pick another port with --port (e.g. {command} --port 5001) or another --host.",
        )
    other = running_ui()
    who = (
        f"`air ui` (pid {other.pid}) already serves this store at {other.base_url}"
        if other is not None and other.port == port
        else "another program listens there"
    )
    free = _free_port_near(host, port)
    raise LaunchError(
        f"Port {port} on {host} is busy: {who}.",
        hint=f"Pick another port with --port, e.g. `{command} --port {free or port + 1}`"
        + (" (free now)." if free else "."),
    )


def _require_pages() -> None:
    """air's pages need Jinja2 beside what mlflow-skinny brings (the `ui` extra has it)."""
    from air.tracking.ui import ui_install_hint

    try:
        import jinja2  # noqa: F401
    except ImportError:
        raise UserInputError("air's pages need Jinja2, which is not installed.", hint=ui_install_hint()) from None


def _page_hosts(host: str) -> list[str] | None:
    """The Host names the pages answer on a loopback address (no login there: a page of another site that
    rebinds its name to 127.0.0.1 must not read them); None (any) on another address."""
    loopback = {"127.0.0.1", "localhost", "::1"}
    return sorted(loopback) if host in loopback else None


def _answers(base: str) -> bool:
    """Whether MLflow's UI at `base` answers its health check yet."""
    import urllib.request

    try:
        with urllib.request.urlopen(base + "/health", timeout=2) as answer:  # http on this machine
            return bool(answer.status == 200)
    except OSError:
        return False


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--port",
    default=5000,
    show_default=True,
    type=click.IntRange(1, 65535),
    help="Port to listen on; a busy port is an error (exit 1).",
)
@click.option(
    "--web-port",
    default=None,
    type=click.IntRange(1, 65535),
    help="Port of air's pages (runs, logs, queue, capacity) [default: --port + 1].",
)
@click.option(
    "--workers",
    default=1,
    show_default=True,
    type=click.IntRange(1, 64),
    help="Server worker processes (MLflow's own default, 4, takes 4x the start-up CPU).",
)
@common
def ui(host: str, port: int, web_port: int | None, workers: int) -> int:
    """Serve air's pages (runs, logs, queue, capacity) and MLflow's UI; print both addresses (Ctrl-C stops).

    Needs MLflow's UI server: `pip install 'air-runtime[ui]'` (`make setup` installs it).
    """
    from air.home import AirHome
    from air.launcher.guard import STOP_SIGNALS, Stopped, guard_argv, raise_stopped
    from air.launcher.procs import terminate_tree
    from air.server.mlflow_server import open_mlflow_log, ui_argv
    from air.tracking import tracking_uri
    from air.tracking.store import is_http
    from air.tracking.ui import forget_ui, record_ui, require_ui_server, ui_environment

    # Checked before AIR_HOME is touched: a missing extra or a busy port writes nothing.
    pages_port = web_port if web_port is not None else (port + 1 if port < 65535 else port - 1)
    if pages_port == port:
        raise UserInputError(f"--web-port {pages_port} is MLflow's --port too.",
                             hint="Give air's pages and MLflow's UI different ports.")
    remote = is_http(os.environ.get("MLFLOW_TRACKING_URI", ""))
    if remote:  # the tracking server has its own UI: air serves only its pages, linking there
        _require_pages()
    else:
        require_ui_server()
        check_port(host, port)
    check_port(host, pages_port)
    stderr(f"air ui: starting air's pages on http://{host}:{pages_port}"
           + ("" if remote else f" and MLflow's UI on http://{host}:{port} (seconds; more on a loaded machine)") + " ...")
    # After the check: the pages need Starlette, uvicorn and Jinja2, which the `ui` extra brings.
    from air.web import create_web_app
    from air.web.serve import PageServer

    uri = tracking_uri()
    tag = f"air-ui-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    previous = {sig: signal.signal(sig, raise_stopped) for sig in STOP_SIGNALS}
    proc: subprocess.Popen[bytes] | None = None
    pages: PageServer | None = None
    recorded = False
    mlflow_base = uri.rstrip("/") if remote else f"http://{host}:{port}"
    log = AirHome().ui_log
    try:
        # air's pages first (they answer in seconds); MLflow's UI starts beside them (seconds).
        pages = PageServer(create_web_app(mlflow_url=lambda: mlflow_base, hosts=_page_hosts(host)), host, pages_port)
        pages.start()
        if remote:  # with a tracking server (MLFLOW_TRACKING_URI=http…): air's pages alone, linking to its UI
            record_ui(host, 0, uri, web_port=pages_port)  # no MLflow UI of its own (port 0)
            recorded = True
            stderr(f"air pages (runs, logs, queue, capacity) at http://{host}:{pages_port}")
            stderr(f"MLflow UI: {mlflow_base} (MLFLOW_TRACKING_URI's server)  (Ctrl-C to stop)")
            while pages.thread.is_alive():
                pages.thread.join(1.0)
            return 1  # the pages' server ended by itself
        stderr(f"air pages (runs, logs, queue, capacity) at http://{host}:{pages_port}")
        started = time.monotonic()
        argv = ui_argv(host, port, workers)  # one process importing MLflow once, not `mlflow ui`'s CLI and workers
        with open_mlflow_log(log, "air ui") as out:
            proc = subprocess.Popen(guard_argv(argv), env={**ui_environment(os.environ), AIR_PROCESS_TAG: tag},
                                    start_new_session=True, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
        record_ui(host, port, uri, web_port=pages_port)
        recorded = True
        stderr(f"MLflow UI for {uri} starting at {mlflow_base} (its output: {log}) ...  (Ctrl-C to stop)")
        while proc.poll() is None:
            if _answers(mlflow_base):
                stderr(f"MLflow UI ready ({time.monotonic() - started:.0f} s) at {mlflow_base}")
                return proc.wait()
            time.sleep(0.5)
        stderr(f"MLflow UI exited with status {proc.returncode} while starting; its output: {log}")
        return proc.returncode or 1
    except Stopped:
        return 0
    finally:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        try:
            if pages is not None:
                pages.stop()
            terminate_tree([proc] if proc is not None else [], tag=tag)
        finally:
            if recorded:
                forget_ui()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
