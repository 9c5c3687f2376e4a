"""The MLflow tracking server `air server` runs beside its API, over its own store, so every node on
every machine logs to one place, through the air server's door (air.server.mlflow_door) only.

MLflow listens on no TCP port at all: it runs as one process (air.server.mlflow_app: MLflow's own app
served by uvicorn in that process, not `mlflow server`'s CLI and worker processes), which binds a Unix
socket (ServerPaths.mlflow_socket) in a 0700 folder of the server's account, so no other process of the
machine (another user's run included, which shares the network namespace) can reach it without a token;
only the door connects to it. It serves under the path prefix `/mlflow`, so the door forwards paths
unchanged and MLflow's own UI works behind it. The supervisors and call drivers the server starts reach
MLflow through the door too, at its local address, with the server's own credential (a random secret
kept 0600 beside the server's state, stable across restarts since supervisors outlive the server) and,
under TLS, the trust they need (`supervisor_env`); they hand nodes the door's public address
(AIR_MLFLOW_DOOR) with a per-run credential instead (air.runs.credentials), and no node ever gets what
the supervisors got (AIR_SUPERVISOR_ONLY, air.settings.node_environ). Artifacts are proxied
(`mlflow-artifacts:/`): a node uploads through the door, never into the server's folders.

The API does not wait for it: MLflow starts beside it (seconds on a quiet machine, more under load), its
output into the server's log (ServerPaths.log); until it answers, the door says 503 "MLflow is
starting" and GET /api/v1/health reports its state (MLflowState).

It runs under the guard `air ui`'s MLflow server runs under (air.launcher.guard):
however the air server ends, even by SIGKILL, MLflow's whole tree ends with it and frees its port. An
MLFLOW_TRACKING_URI already set in the server's environment wins: then no MLflow server (and no door)
is started.
"""

from __future__ import annotations

import http.client
import io
import os
import secrets
import shutil
import socket
import ssl
import stat
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from air.errors import LaunchError, UserInputError
from air.files import atomic_write_text
from air.processes import PROCESS_KINDS
from air.settings import AIR_MLFLOW_DOOR, AIR_MLFLOW_HOLD, AIR_PROCESS_TAG, AIR_SUPERVISOR_ONLY

#: How long the MLflow server may take to answer /health (its start imports a lot; a loaded machine is slow).
MLFLOW_START_TIMEOUT_S = 180.0
#: The door's local address for a wildcard or loopback bind (what supervisors on this machine connect to).
LOOPBACK = "127.0.0.1"
#: Longest path a Unix socket may have (sun_path is 108 bytes with its terminating NUL).
SOCKET_PATH_MAX = 107
#: Every server credential starts with this (a run's with `airrun_`, an API token with `air_`).
SERVER_CREDENTIAL_PREFIX = "airsrv_"
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


class _UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP over a Unix socket (the health check at start; the door itself uses aiohttp)."""

    def __init__(self, path: Path, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(str(self._path))
        except OSError:
            sock.close()
            raise
        self.sock = sock


def _healthy(path: Path) -> bool:
    connection = _UnixHTTPConnection(path, timeout=2)
    try:
        connection.request("GET", MLFLOW_PREFIX + "/health")
        return connection.getresponse().status == 200
    except OSError:
        return False
    finally:
        connection.close()


def mlflow_argv(sock: Path, store: str | None = None) -> list[str]:
    """MLflow's tracking server over `store` (default: this AIR_HOME's) on the Unix socket `sock` under
    MLFLOW_PREFIX, artifacts proxied and kept in this AIR_HOME: one process of air.server.mlflow_app, which
    imports MLflow's server once and serves it, where `mlflow server` was a CLI process importing it all to
    start a uvicorn process that imported it all again (issue 35: 3 processes' imports, now 1)."""
    from air.tracking.store import artifact_root, is_http, tracking_uri

    uri = tracking_uri() if store is None else store
    if is_http(uri):
        raise UserInputError(f"MLFLOW_TRACKING_URI points at an MLflow server ({uri}); it is not served again.",
                             hint="Unset it to serve this AIR_HOME's store, or let the server use that one.")
    artifact_root().mkdir(parents=True, exist_ok=True, mode=0o700)
    return PROCESS_KINDS["mlflow"].argv("--store", uri, "--socket", str(sock), "--artifacts", artifact_root().as_uri(),
                                        "--static-prefix", MLFLOW_PREFIX)


def ui_argv(host: str, port: int, workers: int = 1) -> list[str]:
    """`air ui`'s MLflow UI: air.server.mlflow_app on `host`:`port` over the current store (the one
    process `mlflow_argv` gives the server, on TCP, without a prefix). New experiments of the embedded store
    keep their artifacts in this AIR_HOME's folder, where `mlflow ui --default-artifact-root` put them."""
    from air.tracking.store import artifact_root, is_embedded, is_http, tracking_uri

    uri = tracking_uri()
    if is_http(uri):
        raise UserInputError(f"MLFLOW_TRACKING_URI points at an MLflow server ({uri}); it serves its own UI.",
                             hint=f"Open {uri} in a browser, or unset MLFLOW_TRACKING_URI to browse air's embedded "
                             "store.")
    root = artifact_root()
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    return PROCESS_KINDS["mlflow"].argv(
        "--store", uri, "--host", host, "--port", str(port), "--artifacts", root.as_uri(), "--artifact-root",
        root.as_uri() if is_embedded(uri) else "mlflow-artifacts:/", "--static-prefix", "", "--workers", str(workers))


def _private_folder(path: Path) -> None:
    """`path` made (or kept) a folder of this account alone, 0700: the socket's only wall."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise LaunchError(f"{path} is not a folder of this account: MLflow's socket cannot be kept there.",
                          hint="Remove it, or give the server another AIR_HOME.")
    os.chmod(path, 0o700)


@contextmanager
def socket_folder() -> Iterator[Path]:
    """The socket MLflow listens on, in a 0700 folder, while the block runs.

    Its place is ServerPaths.mlflow_socket, unless that path is longer than a socket path may be (a deep
    AIR_HOME): then a fresh 0700 folder made by tempfile (under TMPDIR, else /tmp), removed afterwards.
    Either way only the server's account can reach the socket (a folder of mode 0700 stops a connect)."""
    from air.server.uploads import ServerPaths

    sock = ServerPaths.here().mlflow_socket
    temporary: Path | None = None
    if len(os.fsencode(str(sock))) > SOCKET_PATH_MAX:
        temporary = Path(tempfile.mkdtemp(prefix="air-mlflow-"))  # mkdtemp makes it 0700
        sock = temporary / sock.name
    _private_folder(sock.parent)
    if sock.exists() or sock.is_symlink():
        if _healthy(sock):
            raise UserInputError(f"Another air server's MLflow already serves this AIR_HOME (at {sock}).",
                                 hint="Stop that server first, or give this one another AIR_HOME.")
        sock.unlink()  # left by a server that was killed
    try:
        yield sock
    finally:
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)
        else:
            sock.unlink(missing_ok=True)


def server_credential() -> str:
    """The server's own MLflow credential: full rights at the door, for its supervisors and call drivers.
    Kept 0600 (ServerPaths.mlflow_credential) and the same across restarts: supervisors outlive the server
    and still hold the value they were started with."""
    from air.server.uploads import ServerPaths

    path = ServerPaths.here().mlflow_credential
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        value = path.read_text().strip()
    except FileNotFoundError:
        value = ""
    if value.startswith(SERVER_CREDENTIAL_PREFIX) and len(value) > len(SERVER_CREDENTIAL_PREFIX) + 32:
        os.chmod(path, 0o600)
        return value
    value = SERVER_CREDENTIAL_PREFIX + secrets.token_urlsafe(32)
    atomic_write_text(path, value + "\n", mode=0o600)
    return value


def local_door(host: str, port: int, *, tls: bool) -> str:
    """The door as this machine's supervisors reach it: loopback for a wildcard or loopback bind, else
    the bind address."""
    name = LOOPBACK if host in ("0.0.0.0", "::", "", "localhost") or host.startswith("127.") else host
    if host == "::1":
        name = "::1"
    if ":" in name:
        name = f"[{name}]"
    return f"{'https' if tls else 'http'}://{name}:{port}{MLFLOW_PREFIX}"


def cert_verifies(cert: Path, key: Path, name: str) -> bool:
    """Whether a client that trusts only `cert` accepts it for `name` (a self-signed certificate naming
    that host or address): a TLS handshake in memory, with the server's own certificate and key."""
    try:
        client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        client.load_verify_locations(cafile=str(cert))
        server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        server.load_cert_chain(str(cert), str(key))
    except (OSError, ssl.SSLError, ValueError):
        return False
    wires = [ssl.MemoryBIO(), ssl.MemoryBIO()]  # what the client reads (the server writes), and back
    near = client.wrap_bio(wires[0], wires[1], server_hostname=name)
    far = server.wrap_bio(wires[1], wires[0], server_side=True)
    done = {id(near): False, id(far): False}
    for _ in range(20):
        for side in (near, far):
            if done[id(side)]:
                continue
            try:
                side.do_handshake()
                done[id(side)] = True
            except ssl.SSLWantReadError:
                pass
            except (ssl.SSLError, OSError, ValueError):
                return False
        if all(done.values()):
            return True
    return False


def supervisor_env(host: str, port: int, *, credential: str, tls_cert: Path | None = None,
                   tls_key: Path | None = None) -> dict[str, str]:
    """What the server's supervisors and call drivers get to log to MLflow (the door's local address and
    the server credential; under TLS, the certificate to trust when it verifies for that address, else
    MLflow's insecure-TLS switch, for them only). AIR_SUPERVISOR_ONLY lists what no node may inherit."""
    door = local_door(host, port, tls=tls_cert is not None)
    env = {"MLFLOW_TRACKING_URI": door, "MLFLOW_TRACKING_TOKEN": credential}
    if tls_cert is not None and tls_key is not None:
        import urllib.parse

        name = urllib.parse.urlsplit(door).hostname or LOOPBACK
        if cert_verifies(tls_cert, tls_key, name):
            env["MLFLOW_TRACKING_SERVER_CERT_PATH"] = str(tls_cert.resolve())
        else:
            env["MLFLOW_TRACKING_INSECURE_TLS"] = "true"
    env[AIR_SUPERVISOR_ONLY] = ",".join(env)  # a node gets the door's public address and its run's credential
    return env


class MLflowState:
    """Where the server's MLflow stands: `starting`, `ready`, `failed`, or `off` (none started: --no-mlflow
    or an MLFLOW_TRACKING_URI of the server's environment). The API serves at once while MLflow starts
    beside it; the door answers 503 until `ready`, and GET /api/v1/health reports it."""

    def __init__(self, state: str = "off", log: Path | None = None) -> None:
        self._lock = threading.Lock()
        self.state = state
        self.log = log
        self.started = time.monotonic()
        self.ready_after_s: float | None = None
        self.message = ""
        self.changed = threading.Event()

    def set(self, state: str, message: str = "") -> None:
        with self._lock:
            self.state = state
            self.message = message
            if state == "ready":
                self.ready_after_s = round(time.monotonic() - self.started, 1)
        self.changed.set()

    def waited_s(self) -> float:
        return round(time.monotonic() - self.started, 1)

    def as_json(self) -> dict[str, object]:
        with self._lock:
            found: dict[str, object] = {"state": self.state}
            if self.state == "starting":
                found["starting_for_s"] = self.waited_s()
            if self.ready_after_s is not None:
                found["ready_after_s"] = self.ready_after_s
            if self.message:
                found["message"] = self.message
            return found


def open_mlflow_log(path: Path, who: str) -> io.FileIO:
    """The log MLflow's output goes to, not the terminal (the server's ServerPaths.log, `air ui`'s
    AirHome.ui_log): appended to, 0600, after a line saying who starts it when."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    out = os.fdopen(fd, "ab", buffering=0)
    out.write(f"\n==== {who} {os.getpid()}: MLflow starting at {time.strftime('%Y-%m-%d %H:%M:%S %z')}\n".encode())
    return out


class _Starter:
    """MLflow's start, off the serving thread (the API must not wait for it; MLflow's own process
    imports MLflow and prepares the store, which takes seconds, more on a loaded machine). Then watch it answer
    on `sock` (and AIR_MLFLOW_HOLD's file, when set): `ready`; `failed` when it exits first, cannot be
    started, or takes longer than MLFLOW_START_TIMEOUT_S."""

    def __init__(self, sock: Path, store: str, state: MLflowState,
                 on_change: Callable[[MLflowState], None] | None) -> None:
        self.sock = sock
        self.store = store
        self.state = state
        self.on_change = on_change
        self.tag = f"air-server-mlflow-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.stopping = threading.Event()
        self._lock = threading.Lock()

    def run(self) -> None:
        from air.launcher.guard import guard_argv
        from air.tracking.ui import ui_environment

        where = f" (its output: {self.state.log})" if self.state.log else ""
        try:
            argv = mlflow_argv(self.sock, self.store)
            with self._lock:
                if self.stopping.is_set():
                    return
                assert self.state.log is not None
                with open_mlflow_log(self.state.log, "air server") as out:
                    self.proc = subprocess.Popen(guard_argv(argv), env={**ui_environment(os.environ), AIR_PROCESS_TAG: self.tag},
                                                 start_new_session=True, stdin=subprocess.DEVNULL, stdout=out,
                                                 stderr=out)
        except Exception as exc:  # said as `failed`; the API keeps serving
            self._say("failed", f"MLflow could not be started: {exc}{where}.")
            return
        hold = os.environ.get(AIR_MLFLOW_HOLD)
        deadline = time.monotonic() + MLFLOW_START_TIMEOUT_S
        while not self.stopping.is_set():
            if _healthy(self.sock) and (not hold or os.path.exists(hold)):
                self._say("ready")
                break
            if self.proc.poll() is not None:
                self._say("failed", f"MLflow exited with status {self.proc.returncode} while starting{where}.")
                break
            if time.monotonic() > deadline:
                self._say("failed", f"MLflow did not answer within {MLFLOW_START_TIMEOUT_S:.0f} s{where}.")
                break
            self.stopping.wait(0.25)
        # This thread started MLflow's guard, whose pdeathsig follows this thread: it lives until stop().
        while not self.stopping.wait(1.0):
            if self.state.state == "ready" and self.proc.poll() is not None:
                self._say("failed", f"MLflow exited with status {self.proc.returncode}{where}.")

    def _say(self, state: str, message: str = "") -> None:
        if self.stopping.is_set():
            return
        self.state.set(state, message)
        if self.on_change is not None:
            self.on_change(self.state)

    def stop(self) -> None:
        """End MLflow's whole tree (or keep it from being started at all)."""
        from air.launcher.procs import terminate_tree

        self.stopping.set()
        with self._lock:
            if self.proc is not None:
                terminate_tree([self.proc], tag=self.tag)


@contextmanager
def mlflow_server(*, door: str, supervisor: dict[str, str], enabled: bool = True,
                  on_change: Callable[[MLflowState], None] | None = None) -> Iterator[tuple[Path | None, MLflowState]]:
    """Start MLflow over this AIR_HOME's store on a Unix socket, beside the block (which serves at once);
    yields the socket's path (None when MLFLOW_TRACKING_URI was already set, or `enabled` is false) and its
    MLflowState; `on_change(state)` is called once it is ready or has failed. MLflow's output goes to the
    server's log (ServerPaths.log), never to the terminal. `door`: the address nodes get (`<public
    URL>/mlflow`); `supervisor`: what the supervisors started from here get (supervisor_env), set in this
    process's environment at once: a supervisor started while MLflow starts waits for it at the door
    (air.tracking.ui.wait_for_tracking_server)."""
    from air.server.uploads import ServerPaths
    from air.tracking.store import tracking_uri
    from air.tracking.ui import require_ui_server

    if os.environ.get("MLFLOW_TRACKING_URI") or not enabled:
        yield None, MLflowState("off")
        return
    require_ui_server()
    with socket_folder() as sock:
        # The store is named now: MLFLOW_TRACKING_URI is the door's below, for the supervisors.
        starter = _Starter(sock, tracking_uri(), MLflowState("starting", ServerPaths.here().log), on_change)
        try:
            os.environ.update(supervisor)  # the supervisors and call drivers started from here inherit it
            os.environ[AIR_MLFLOW_DOOR] = door
            threading.Thread(target=starter.run, name="air-server-mlflow-start", daemon=True).start()
            yield sock, starter.state
        finally:
            for key in (AIR_MLFLOW_DOOR, *supervisor):
                os.environ.pop(key, None)
            starter.stop()

