"""The MLflow tracking server `air server` runs beside its API, over its own store, so every node on
every machine logs to one place, through the air server's door (air.server.mlflow_door) only.

MLflow itself listens on 127.0.0.1 (`--mlflow-port`, the loopback port), under the path prefix `/mlflow`,
so the door forwards paths unchanged and MLflow's own UI works behind it. The supervisors the server
starts inherit the loopback URI (MLFLOW_TRACKING_URI: they run as the server's account, on this
machine) and the door's public address (AIR_MLFLOW_DOOR), which is what they hand to nodes with a
per-run credential (air.runs.credentials). Artifacts are proxied (`mlflow-artifacts:/`): a node uploads
through the door, never into the server's folders.

It is `air ui`'s MLflow server (air.tracking.ui.ui_command) under the same guard (air.launcher.guard):
however the air server ends, even by SIGKILL, MLflow's whole tree ends with it and frees its port. An
MLFLOW_TRACKING_URI already set in the server's environment wins: then no MLflow server (and no door)
is started.
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
from air.settings import AIR_MLFLOW_DOOR, AIR_PROCESS_TAG

#: How long the MLflow server may take to answer /health (its start imports a lot; a loaded machine is slow).
MLFLOW_START_TIMEOUT_S = 180.0
#: Where MLflow listens: loopback only, so nothing of it is reachable but through the door.
LOOPBACK = "127.0.0.1"
#: The path MLflow serves under (its `--static-prefix`), the same on loopback and at the door.
MLFLOW_PREFIX = "/mlflow"


def advertised_host(host: str) -> str:
    """The address nodes on other machines reach the server at (a wildcard bind is not an address)."""
    return socket.getfqdn() if host in ("0.0.0.0", "::", "") else host


def public_url(host: str, port: int, *, tls: bool, given: str | None = None) -> str:
    """The server's address as nodes and browsers use it: `--public-url`, else the bind address (a
    wildcard bind: this machine's FQDN)."""
    if given:
        return given.rstrip("/")
    name = advertised_host(host)
    if ":" in name:
        name = f"[{name}]"
    return f"{'https' if tls else 'http'}://{name}:{port}"


def check_public_url(url: str) -> str:
    """`--public-url` as given, without a trailing slash; UserInputError when it is not an http(s)
    address of a host (nodes could not reach MLflow at it)."""
    import urllib.parse

    from air.errors import UserInputError

    parts = urllib.parse.urlsplit(url.strip())
    try:
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        parts = parts._replace(netloc="")
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise UserInputError(f"--public-url {url!r} is not an http(s) address of this server.",
                             hint="Give the address nodes and browsers reach it at, e.g. "
                             "--public-url https://air.team.example:8765")
    return parts.geturl().rstrip("/")


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as response:  # noqa: S310 - our own http URL
            return bool(response.status == 200)
    except OSError:
        return False


def mlflow_argv(port: int) -> list[str]:
    """`mlflow server` on loopback under MLFLOW_PREFIX, artifacts proxied and kept in this AIR_HOME."""
    from air.tracking.store import artifact_root
    from air.tracking.ui import ui_command

    argv = ui_command(host=LOOPBACK, port=port, workers=1)
    if "--default-artifact-root" in argv:  # the embedded store's file root: nodes would write there directly
        at = argv.index("--default-artifact-root")
        del argv[at:at + 2]
    artifact_root().mkdir(parents=True, exist_ok=True, mode=0o700)
    return argv + ["--static-prefix", MLFLOW_PREFIX, "--serve-artifacts", "--artifacts-destination",
                   artifact_root().as_uri(), "--default-artifact-root", "mlflow-artifacts:/"]


@contextmanager
def mlflow_server(host: str, port: int, door: str | None = None) -> Iterator[str | None]:
    """Serve MLflow over this AIR_HOME's store on 127.0.0.1:`port` while the block runs; yields its
    loopback URI (None when MLFLOW_TRACKING_URI was already set, or `port` is 0). `door`: the address
    nodes get instead (`<public URL>/mlflow`). `host` (the API's bind address) is not where MLflow
    listens: it is kept for callers that still pass it."""
    from air.launcher.guard import guard_argv
    from air.launcher.procs import terminate_tree
    from air.tracking.ui import require_ui_server

    if os.environ.get("MLFLOW_TRACKING_URI") or port == 0:
        yield None
        return
    require_ui_server()
    argv = mlflow_argv(port)
    tag = f"air-server-mlflow-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    proc = subprocess.Popen(guard_argv(argv), env={**os.environ, AIR_PROCESS_TAG: tag}, start_new_session=True,
                            stdin=subprocess.DEVNULL)
    url = f"http://{LOOPBACK}:{port}{MLFLOW_PREFIX}"
    try:
        deadline = time.monotonic() + MLFLOW_START_TIMEOUT_S
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise LaunchError(f"The MLflow server for air server did not start on {url}.",
                                  hint="Pick another loopback port with --mlflow-port, or 0 to serve none.")
            time.sleep(0.2)
        os.environ["MLFLOW_TRACKING_URI"] = url  # the supervisors started from here inherit both
        if door:
            os.environ[AIR_MLFLOW_DOOR] = door
        yield url
    finally:
        os.environ.pop(AIR_MLFLOW_DOOR, None)
        terminate_tree([proc], tag=tag)


__all__ = ["LOOPBACK", "MLFLOW_PREFIX", "advertised_host", "check_public_url", "mlflow_argv", "mlflow_server", "public_url"]
