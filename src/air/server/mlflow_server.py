"""The MLflow tracking server `air server` runs beside its API, over its own store, so every node on
every machine logs to one place: its http URI becomes the MLFLOW_TRACKING_URI of the supervisors the
server starts, and so of every node and rank (and the UI link of `air get run`).

It is `air ui`'s MLflow server (air.tracking.ui.ui_command) under the same guard (air.launcher.guard):
however the air server ends, even by SIGKILL, MLflow's whole tree ends with it and frees its port. An
MLFLOW_TRACKING_URI already set in the server's environment wins: then no MLflow server is started.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from air.errors import LaunchError
from air.settings import AIR_PROCESS_TAG

#: How long the MLflow server may take to answer /health (its start imports a lot; a loaded machine is slow).
MLFLOW_START_TIMEOUT_S = 180.0


def advertised_host(host: str) -> str:
    """The address nodes on other machines reach the server at (a wildcard bind is not an address)."""
    return socket.getfqdn() if host in ("0.0.0.0", "::", "") else host


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as response:  # noqa: S310 - our own http URL
            return bool(response.status == 200)
    except OSError:
        return False


@contextmanager
def mlflow_server(host: str, port: int) -> Iterator[str | None]:
    """Serve MLflow over this AIR_HOME's store on host:port while the block runs; yields the tracking
    URI the server's runs use (None when MLFLOW_TRACKING_URI was already set, or `port` is 0)."""
    from air.launcher.guard import guard_argv
    from air.launcher.procs import terminate_tree
    from air.tracking.store import is_http
    from air.tracking.ui import require_ui_server, ui_command

    if os.environ.get("MLFLOW_TRACKING_URI") or port == 0:
        yield None
        return
    require_ui_server()
    argv = ui_command(host=host, port=port, workers=1)
    tag = f"air-server-mlflow-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    proc = subprocess.Popen(guard_argv(argv), env={**os.environ, AIR_PROCESS_TAG: tag}, start_new_session=True,
                            stdin=subprocess.DEVNULL)
    url = f"http://{advertised_host(host)}:{port}"
    try:
        deadline = time.monotonic() + MLFLOW_START_TIMEOUT_S
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise LaunchError(f"The MLflow server for air server did not start on {url}.",
                                  hint="Pick another port with --mlflow-port, or 0 to serve none.")
            time.sleep(0.2)
        assert is_http(url)
        os.environ["MLFLOW_TRACKING_URI"] = url  # the supervisors started from here inherit it
        yield url
    finally:
        terminate_tree([proc], tag=tag)
