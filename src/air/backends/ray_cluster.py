"""Starting and stopping one Ray node that belongs to air, without touching anyone else's Ray.

Several Ray clusters share a machine here (one per `ray_launch` call, the test cluster, other users'),
so nothing below relies on a Ray default: every port is picked free (`reserve_port`), every node gets
its own `--temp-dir` (which also keeps `ray.init(address="auto")` of *other* clusters away from it),
and authentication is set explicitly (Ray ≥ 2.59 turns token auth on by itself when it finds
`~/.ray/auth_token`, which silently locks out clients that do not have that file).

Every process a node starts carries `AIR_RAY_NODE=<marker>` in its environment (raylet, GCS, workers
all inherit it), so `stop()` ends exactly this node's processes, and never runs `ray stop`, which
kills every Ray process of the machine.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from air.errors import RayInitializationError
from air.launcher import reserve_port
from air.settings import AIR_KEEP_RAY_TEMP, AIR_RAY_NODE, AIR_RAY_TEMP_ROOT, node_environ

#: Ray's own authentication switches (see the module docstring).
AUTH_MODE_ENV = "RAY_AUTH_MODE"
AUTH_TOKEN_ENV = "RAY_AUTH_TOKEN"

#: Environment variables Ray sets for its own worker processes; a process air starts from inside a
#: Ray worker (an agent) must not pass them on, or a nested `ray start`/`ray.init` gets confused.
RAY_WORKER_ENV = (
    "RAY_JOB_ID", "RAY_RAYLET_PID", "RAY_NODE_ID", "RAY_CLIENT_MODE", "RAY_LD_PRELOAD_ON_WORKERS",
    "RAY_JOB_CONFIG_JSON_ENV_VAR", "RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH",
    "RAY_RUNTIME_ENV_CREATE_WORKING_DIR", "RAY_NAMESPACE", AIR_RAY_NODE,
)

#: Ports a node listens on besides the GCS port (head only: client server and dashboard).
_NODE_PORTS = ("node-manager-port", "object-manager-port", "dashboard-agent-listen-port",
               "dashboard-agent-grpc-port", "runtime-env-agent-port", "metrics-export-port")
_HEAD_PORTS = ("ray-client-server-port", "dashboard-port")

#: `ray start` runs in a session of its own, and so do the daemons it leaves (GCS, raylet, dashboard and its
#: agent). With the kernel's autogroup scheduling (kernel.sched_autogroup_enabled, on by default on most
#: distributions) a session shares the CPU as one group: a busy caller's session (its ranks, data loaders,
#: busy loops) then no longer starves Ray's start-up past the fixed waits below. Measured on 2 cores beside
#: 16 busy loops: a head with its dashboard up in 12-19 s, against 81-316 s (2 of 3 failing all tries) in the
#: caller's session. air ends these processes by their marker, never by session or process group.
OWN_SESSION = True

#: What `ray start` says when its node did not register in time: Ray's fixed 30 s (ray/_private/node.py).
#: The raylet used to end such starts early, aborting when its dashboard agent had not written its port
#: file within a fixed 15 s; air.backends.ray_cli now tells it the port, so it no longer waits on the file.
#: Neither wait has a setting.
STARTUP_TIMEOUT = "timed out during startup"
#: Tries of a `ray start` that failed that way, its partial node ended between them.
START_TRIES = 3
#: How long a head's `ray start` waits for its dashboard to publish its address. Ray's own 60 s
#: (RAY_DASHBOARD_STARTUP_TIMEOUT_S) fails the whole start on a busy machine (CI: a head beside 8 busy loops
#: on 2 cores); a dashboard that dies still fails the start at once (Ray polls its process), so the longer
#: wait costs only where the machine is slow. A value the user set is kept.
DASHBOARD_STARTUP_WAIT_S = 150
#: How long a raylet waits for its runtime-env agent to answer (RAY_agent_register_timeout_ms, Ray's 30 s):
#: the same patience, for the same reason. A value the user set is kept.
AGENT_REGISTER_WAIT_S = 150

T = TypeVar("T")


def startup_timed_out(output: str | bytes) -> bool:
    """Whether a failed `ray start` failed on Ray's node-startup timeout (worth another try)."""
    if isinstance(output, bytes):
        return STARTUP_TIMEOUT.encode() in output
    return STARTUP_TIMEOUT in output


def retry_start(once: Callable[[int], tuple[T, bool]], end_partial: Callable[[], int],
                say: Callable[[str], None], tries: int = START_TRIES) -> T:
    """The one retry of a `ray start` (air's own nodes and the workload `ray` shim): `once(attempt)` gives
    its result and whether it failed on Ray's startup timeout; such a failure ends the partial node
    (`end_partial`, returns how many processes it ended), says so and tries again, `tries` times at most.
    Why: the timeouts are fixed inside Ray, and a second try usually finds the machine's caches warm."""
    for attempt in range(1, tries + 1):
        result, timed_out = once(attempt)
        if not timed_out or attempt == tries:
            return result
        ended = end_partial()
        say(f"Ray gave up waiting for this node to register (its fixed 30 s; the machine is busy); ended its "
            f"{ended} partial process(es), trying again ({attempt + 1} of {tries})")
    raise AssertionError("unreachable")  # pragma: no cover - the loop returns


@dataclass(frozen=True)
class RayAuth:
    """How a cluster authenticates: `token` with a shared secret (air's default for clusters it starts),
    or `disabled`. Written into the environment of every Ray process and of every client."""

    mode: str = "token"
    token: str | None = None

    @classmethod
    def new_token(cls) -> RayAuth:
        return cls("token", secrets.token_hex(16))

    def env(self) -> dict[str, str]:
        if self.mode == "token":
            if not self.token:
                raise ValueError("token auth needs a token")
            return {AUTH_MODE_ENV: "token", AUTH_TOKEN_ENV: self.token}
        return {AUTH_MODE_ENV: "disabled"}


@dataclass
class RayNode:
    """One Ray node air started: stop it with `stop()` (only its own processes)."""

    marker: str
    address: str
    head: bool
    temp_dir: Path
    ports: dict[str, int]
    auth: RayAuth
    owns_temp_dir: bool = True
    log: str = ""
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def metrics_export_port(self) -> int:
        return self.ports["metrics-export-port"]

    @property
    def dashboard_url(self) -> str | None:
        port = self.ports.get("dashboard-port")
        return f"http://{self.address.rsplit(':', 1)[0]}:{port}" if port else None

    def processes(self) -> list:
        return processes_with_env(AIR_RAY_NODE, self.marker)

    def stop(self, grace_s: float = 2.0, *, remove_temp_dir: bool | None = None) -> int:
        """End this node's processes (SIGTERM, `grace_s`, SIGKILL); returns how many there were."""
        count = stop_marked(self.marker, grace_s=grace_s)
        if remove_temp_dir if remove_temp_dir is not None else self.owns_temp_dir:
            if not os.environ.get(AIR_KEEP_RAY_TEMP):
                shutil.rmtree(self.temp_dir, ignore_errors=True)
        return count


def use_auth(auth: RayAuth) -> None:
    """Make this process a client of a cluster with `auth`. Ray caches the mode when `ray._raylet` is
    first imported, so an already-imported Ray is told to read it again."""
    os.environ.update(auth.env())
    if auth.mode != "token":
        os.environ.pop(AUTH_TOKEN_ENV, None)
    refresh_auth()


def refresh_auth() -> None:
    """Have an already-imported Ray re-read RAY_AUTH_MODE/RAY_AUTH_TOKEN from the environment (it caches
    them at import; a client whose variables were set later would otherwise fail to authenticate)."""
    raylet = sys.modules.get("ray._raylet")
    if raylet is not None:
        try:
            raylet.Config.initialize("")
            raylet.AuthenticationTokenLoader.instance().reset_cache()
        except Exception:  # older Ray without these: nothing was cached
            pass


def processes_with_env(key: str, value: str) -> list:
    """This user's processes whose initial environment holds key=value (read from /proc)."""
    import psutil

    needle = f"{key}={value}".encode()
    me = os.getpid()
    found = []
    for pid in psutil.pids():
        if pid == me:
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                if needle not in fh.read().split(b"\0"):
                    continue
            found.append(psutil.Process(pid))
        except (OSError, psutil.Error):
            continue
    return found


def stop_marked(marker: str, *, grace_s: float = 2.0) -> int:
    """End every process carrying AIR_RAY_NODE=marker: SIGTERM, `grace_s`, SIGKILL (the launcher's
    staged teardown). The Python parts exit within a second of SIGTERM; raylet, GCS and the autoscaler
    monitor (measured, Ray 2.60) ignore it for many seconds, and a throwaway node needs no drain."""
    from air.launcher import terminate_tree

    procs = processes_with_env(AIR_RAY_NODE, marker)
    if procs:
        terminate_tree(others=procs, grace_s=grace_s)
        # Processes forked during the grace period (a worker being started) are caught on a second pass.
        late = processes_with_env(AIR_RAY_NODE, marker)
        if late:
            terminate_tree(others=late, grace_s=0.5)
    return len(procs)


def ray_executable() -> list[str]:
    """The `ray` CLI of this interpreter's environment (not whatever `ray` is first on PATH), through
    air.backends.ray_cli so its raylet never waits on the dashboard agent's port file."""
    return ray_cli_under(sys.executable)


def ray_cli_under(python: str) -> list[str]:
    """Ray's `ray` command as `python` runs it, through air.backends.ray_cli (a script of no air imports,
    so a user's environment without air runs it too)."""
    return [python, str(Path(__file__).with_name("ray_cli.py"))]


def short_temp_dir(prefix: str = "air-ray") -> Path:
    """A new, short folder for `--temp-dir`: Ray puts Unix sockets under it (path limit ~107 bytes)."""
    base = Path(os.environ.get(AIR_RAY_TEMP_ROOT) or tempfile.gettempdir())
    path = base / f"{prefix}-{os.getuid()}-{secrets.token_hex(4)}"
    path.mkdir(parents=True, mode=0o700)
    return path


def with_patient_waits(env: Mapping[str, str]) -> dict[str, str]:
    """`env` for a `ray start`, with Ray's settable start-up waits made long enough for a busy machine
    (DASHBOARD_STARTUP_WAIT_S) where the user has not set them."""
    patient = dict(env)
    patient.setdefault("RAY_DASHBOARD_STARTUP_TIMEOUT_S", str(DASHBOARD_STARTUP_WAIT_S))
    # The raylet's wait for its runtime-env agent (a Python process that loads aiohttp and more) before
    # it starts a worker; past it the raylet exits ("the runtime env agent timed out"). Ray's default: 30 s.
    patient.setdefault("RAY_agent_register_timeout_ms", str(AGENT_REGISTER_WAIT_S * 1000))
    return patient


def clean_ray_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` without the variables Ray sets for its own workers (see RAY_WORKER_ENV), nor what `air
    server` gave its supervisors only (a Ray node's processes are nodes' processes)."""
    return {k: v for k, v in node_environ(env).items() if k not in RAY_WORKER_ENV}


def start_ray_node(
    *,
    head: bool,
    address: str | None = None,
    gcs_port: int | None = None,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    resources: Mapping[str, float] | None = None,
    labels: Mapping[str, str] | None = None,
    object_store_memory: int | None = None,
    auth: RayAuth | None = None,
    temp_dir: Path | None = None,
    node_ip_address: str | None = None,
    include_dashboard: bool = False,
    system_config: Mapping[str, object] | None = None,
    env: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
    timeout_s: float = 240.0,
    retry_until: float | None = None,
    executable: Sequence[str] | None = None,
) -> RayNode:
    """Run `ray start` (head, or joining `address`) with free ports and its own temp dir; wait until
    the node is up. A start Ray gave up on (its fixed start-up waits, on a busy machine) is tried again
    (`retry_start`); `retry_until` (a monotonic deadline) retries a joining node while the head is not
    up yet; each try may take `timeout_s`. `executable`: the `ray` CLI (default: this interpreter's).
    RayInitializationError carries Ray's own output when it fails."""
    if not head and not address:
        raise ValueError("a worker node needs the head's address")
    auth = auth or RayAuth.new_token()
    marker = f"{'head' if head else 'node'}-{secrets.token_hex(6)}"
    owns_temp = temp_dir is None
    temp_dir = temp_dir or short_temp_dir()
    reservations = []
    ports: dict[str, int] = {}
    try:
        names = list(_NODE_PORTS) + (list(_HEAD_PORTS) if head else [])
        if not include_dashboard and head:
            names.remove("dashboard-port")
        for name in names:
            reservation = reserve_port("0.0.0.0")
            reservations.append(reservation)
            ports[name] = reservation.port
        if head:
            if gcs_port is None:
                reservation = reserve_port("0.0.0.0")
                reservations.append(reservation)
                gcs_port = reservation.port
            ports["port"] = gcs_port
        argv = [*(executable or ray_executable()), "start", "--disable-usage-stats", f"--temp-dir={temp_dir}",
                "--min-worker-port=0", "--max-worker-port=0"]
        argv += [f"--{name}={port}" for name, port in ports.items()]
        if head:
            argv += ["--head", f"--include-dashboard={'true' if include_dashboard else 'false'}"]
            if include_dashboard:
                argv.append("--dashboard-host=0.0.0.0")
            if system_config:
                argv.append(f"--system-config={json.dumps(dict(system_config))}")
        else:
            argv.append(f"--address={address}")
        if num_cpus is not None:
            argv.append(f"--num-cpus={int(num_cpus)}")
        if num_gpus is not None:
            argv.append(f"--num-gpus={int(num_gpus)}")
        if resources:
            argv.append(f"--resources={json.dumps(dict(resources))}")
        if labels:
            argv.append(f"--labels={','.join(f'{k}={v}' for k, v in labels.items())}")
        if object_store_memory:
            argv.append(f"--object-store-memory={int(object_store_memory)}")
        if node_ip_address:
            argv.append(f"--node-ip-address={node_ip_address}")
        argv += list(extra_args)
        child_env = with_patient_waits(clean_ray_env(env if env is not None else os.environ))
        child_env.update(auth.env())
        child_env.update({AIR_RAY_NODE: marker, "RAY_USAGE_STATS_ENABLED": "0"})
        # The node's own processes (Ray Train's PlacementGroupCleaner, any state-API call in a task) find
        # this cluster by RAY_ADDRESS; without it Ray looks for every GCS of the machine and fails with
        # "Found multiple active Ray instances" as soon as an unrelated cluster runs beside this one.
        own_address = f"{node_ip_address or _node_ip()}:{gcs_port}" if head else str(address)
        child_env["RAY_ADDRESS"] = own_address
        where = "the head node" if head else f"a node joining {address}"

        def once(_attempt: int) -> tuple[subprocess.CompletedProcess[str], bool]:
            """One `ray start`; a joining node is retried here while the head is not up yet."""
            while True:
                try:
                    done = subprocess.run(argv, env=child_env, stdin=subprocess.DEVNULL, capture_output=True,
                                          text=True, timeout=timeout_s, start_new_session=OWN_SESSION)
                except subprocess.TimeoutExpired as exc:
                    stop_marked(marker, grace_s=1.0)
                    raise RayInitializationError(
                        f"`ray start` for {where} did not finish within {timeout_s:g} s.",
                        hint=f"Ray's logs: {temp_dir}/session_latest/logs",
                    ) from exc
                if done.returncode == 0:
                    return done, False
                if startup_timed_out(done.stdout + done.stderr):
                    return done, True
                stop_marked(marker, grace_s=1.0)
                if retry_until is None or time.monotonic() >= retry_until:
                    return done, False
                time.sleep(1.0)

        # The reservations stay held until Ray has bound the ports: no other air launch takes them.
        done = retry_start(once, lambda: stop_marked(marker, grace_s=1.0),
                           lambda note: print(f"[air] ray start ({where}): {note}", flush=True))
        if done.returncode != 0:
            stop_marked(marker, grace_s=1.0)
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-20:])
            raise RayInitializationError(
                f"Failed to start a Ray cluster: `ray start` for {where} exited with {done.returncode}.\n{tail}",
                hint=f"Ray's logs: {temp_dir}/session_latest/logs",
            )
    finally:
        for reservation in reservations:
            reservation.release()
    return RayNode(marker=marker, address=own_address, head=head, temp_dir=temp_dir, ports=ports, auth=auth,
                   owns_temp_dir=owns_temp, log=done.stdout + done.stderr)


def _node_ip() -> str:
    """The IP a head started without --node-ip-address takes (Ray's own choice, which `ray start` prints)."""
    from ray.util import get_node_ip_address

    return str(get_node_ip_address())

