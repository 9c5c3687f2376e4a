"""A `ray` command for workload nodes, so a command that starts Ray by hand (seed 000: `ray start
--head` on NODE_RANK 0, `ray start --address=$MASTER_ADDR:6379 --block` elsewhere, `ray stop` at the
end) works on any multi-node allocation, also when several nodes share a host or a host already runs
another Ray (the Ray backend's own raylet holds Ray's default ports there).

`workload_ray_env()` gives the environment a node needs; its PATH puts this shim first. The shim then:

* `ray start`: adds a free port for every port option the user did not give (dashboard agent, metrics,
  node manager, object manager, runtime-env agent, and on the head client server and dashboard), and
  random worker ports; moves the GCS port to AIR_RAY_HEAD_PORT (free on node 0) both in `--head
  --port=…` and in `--address=$MASTER_ADDR:…`, so a hard-coded 6379 never meets another cluster (a GCS
  put on $MASTER_PORT, which air reserved free on node 0 too, stays there); marks
  every process of the node, so `ray stop` can find them. `ray start --block` on a joining node returns
  0 once the head has gone away (the driver finished and stopped it) instead of retrying for minutes.
  A joining node keeps its own temp dir (`$RAY_TMPDIR/ray`) instead of taking the head's, so nodes on one
  host do not share a session folder (whose logs both nodes' log monitors would send, every line twice).
  It records the node's metrics export port (and whether it is the head) in `$RAY_TMPDIR/air-ray-node.json`,
  where `RayMetricsMonitor()` finds it with no arguments. It runs the user's `ray` by the interpreter its
  `#!` line names, through air.backends.ray_cli, so the raylet is told the dashboard agent's port and never
  aborts waiting for the agent's port file.
* `ray stop`: stops this node's Ray only, never every Ray process of the machine.
* anything else: the real `ray`, unchanged.

RAY_TMPDIR (one short folder per node) keeps sockets apart and makes `ray.init(address="auto")` find
this run's cluster (Ray reads `$RAY_TMPDIR/ray/ray_current_cluster`), not whatever cluster was started
last on the machine. Authentication is explicit: a per-run token in RAY_AUTH_MODE/RAY_AUTH_TOKEN.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from air.backends.ray_cluster import (
    OWN_SESSION,
    RayAuth,
    ray_cli_under,
    ray_executable,
    retry_start,
    startup_timed_out,
    stop_marked,
    with_patient_waits,
)
from air.backends.ray_train_report import train_report_env
from air.files import atomic_write_text
from air.processes import PROCESS_KINDS
from air.settings import AIR_PROCESS_TAG, AIR_RAY_HEAD_PORT, AIR_RAY_NODE, AIR_RAY_SHIM_DIR

_PORT_OPTIONS = ("node-manager-port", "object-manager-port", "dashboard-agent-listen-port",
                 "dashboard-agent-grpc-port", "runtime-env-agent-port", "metrics-export-port")
_HEAD_PORT_OPTIONS = ("ray-client-server-port", "dashboard-port")
#: This node's Ray, as the shim started it (in the node's own RAY_TMPDIR): {"metrics_export_port": …, "head": …}.
NODE_INFO_FILE = "air-ray-node.json"


def install_shim(folder: Path, python: str | None = None) -> Path:
    """Write the `ray` shim into `folder` (idempotent); returns the folder to put first on PATH."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "ray"
    text = f'#!/bin/sh\nexec "{python or sys.executable}" -m {PROCESS_KINDS["ray_shim"].module} "$@"\n'
    if not script.exists() or script.read_text() != text:
        atomic_write_text(script, text, mode=0o755)
    return folder


def workload_ray_env(*, node_rank: int, head_port: int, shim_dir: Path, ray_tmpdir: Path, auth: RayAuth,
                     path: str | None = None, mlflow_run_id: str | None = None,
                     train_callbacks: str | None = None) -> dict[str, str]:
    """What one node's command needs so hand-started Ray works (see the module docstring). It wins over
    the node's own values; the caller also drops RAY_ADDRESS (it points at some other cluster).

    `head_port`: a port reserved free on node 0 (same value on every node). `ray_tmpdir`: a short,
    existing folder on that node (Ray's sockets live below it). `auth`: the same on every node of the run.
    `train_callbacks`: the node's own RAY_TRAIN_CALLBACKS, kept beside air's when an MLflow run is set.
    """
    env = {
        "PATH": f"{shim_dir}{os.pathsep}{path if path is not None else os.environ.get('PATH', '')}",
        AIR_RAY_SHIM_DIR: str(shim_dir), AIR_RAY_HEAD_PORT: str(head_port), "RAY_TMPDIR": str(ray_tmpdir),
        "RAY_USAGE_STATS_ENABLED": "0", **auth.env(),
    }
    env.update(train_report_env(train_callbacks, mlflow=bool(mlflow_run_id), checkpoints=True))
    return env


@contextlib.contextmanager
def local_workload_ray_env(num_nodes: int, *, shim_dir: Path, path: str | None = None,
                           mlflow_run_id: str | None = None,
                           train_callbacks: str | None = None) -> Iterator[list[dict[str, str]]]:
    """For a backend whose nodes all run on this machine (the local backend): one env addition per
    node, for the duration of an attempt. Holds the head port reserved (no other air launch takes it)
    and removes the nodes' RAY_TMPDIRs afterwards. Also drop RAY_ADDRESS from the nodes' env."""
    from air.backends.ray_cluster import short_temp_dir
    from air.launcher import reserve_port

    install_shim(shim_dir)
    auth = RayAuth.new_token()
    tmpdirs = [short_temp_dir("air-rt") for _ in range(num_nodes)]
    try:
        with reserve_port("0.0.0.0") as head:
            yield [workload_ray_env(node_rank=n, head_port=head.port, shim_dir=shim_dir, ray_tmpdir=tmpdirs[n],
                                    auth=auth, path=path, mlflow_run_id=mlflow_run_id,
                                    train_callbacks=train_callbacks) for n in range(num_nodes)]
    finally:
        for tmp in tmpdirs:
            shutil.rmtree(tmp, ignore_errors=True)


def write_node_info(env: Mapping[str, str], rewritten: Sequence[str]) -> None:
    """Record the metrics export port `ray start` gets (the shim picked it, or the user did), so a
    process of this node (RayMetricsMonitor) finds it: Ray itself tells no client of it before `ray.init`."""
    given = _options(rewritten)
    port = given.get("metrics-export-port", (0, None))[1]
    tmpdir = env.get("RAY_TMPDIR")
    if not tmpdir or not port or not port.isdigit():
        return
    try:
        atomic_write_text(Path(tmpdir) / NODE_INFO_FILE,
                          json.dumps({"metrics_export_port": int(port), "head": "head" in given}))
    except OSError:  # a node without its own temp dir: RayMetricsMonitor then needs its metrics_url
        pass


def node_info(env: Mapping[str, str]) -> dict[str, object] | None:
    """What `write_node_info` recorded for this node (None if the shim started no Ray here)."""
    tmpdir = env.get("RAY_TMPDIR")
    if not tmpdir:
        return None
    try:
        found = json.loads((Path(tmpdir) / NODE_INFO_FILE).read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def _is_shim(folder: str) -> bool:
    try:
        head = (Path(folder) / "ray").read_text(errors="replace")[:400]
        return "air.backends.ray_shim" in head or "air.ray.shim" in head  # (its name before it moved)
    except OSError:
        return False


def _real_ray() -> list[str]:
    """The `ray` the user's environment has, found on PATH after this shim's folder."""
    shim_dir = os.environ.get(AIR_RAY_SHIM_DIR, "")
    entries = [p for p in os.environ.get("PATH", "").split(os.pathsep)
               if p and os.path.realpath(p) != os.path.realpath(shim_dir or "/nonexistent") and not _is_shim(p)]
    found = shutil.which("ray", path=os.pathsep.join(entries))
    if found:
        return [found]
    return ray_executable()


def _real_ray_start() -> list[str]:
    """The user's `ray` for `ray start`: run by its own interpreter through air.backends.ray_cli (which
    tells the raylet the dashboard agent's port, see there), or as it is where it is no Python script."""
    real = _real_ray()
    python = _script_python(real[0]) if len(real) == 1 else None
    if python is None:
        return real
    return ray_cli_under(python)


def _script_python(script: str) -> str | None:
    """The interpreter a console script's `#!` line names, where that is an executable Python."""
    try:
        with open(script, "rb") as handle:
            first = handle.readline(4096).decode(errors="replace").strip()
    except OSError:
        return None
    if not first.startswith("#!"):
        return None
    words = first[2:].split()
    python = words[0] if words else ""
    if os.path.basename(python) == "env" and len(words) > 1:
        python = shutil.which(words[1]) or ""
    if not os.path.basename(python).startswith("python") or not os.access(python, os.X_OK):
        return None
    return python


def _options(args: Sequence[str]) -> dict[str, tuple[int, str | None]]:
    """--name[=value] → (index, value) for the options given (value None for a bare flag)."""
    found: dict[str, tuple[int, str | None]] = {}
    for index, arg in enumerate(args):
        if not arg.startswith("--"):
            continue
        name, eq, value = arg[2:].partition("=")
        if eq:
            found[name] = (index, value)
        elif index + 1 < len(args) and not args[index + 1].startswith("--"):
            found[name] = (index, args[index + 1])
        else:
            found[name] = (index, None)
    return found


def _set_option(args: list[str], name: str, value: str) -> list[str]:
    """Replace --name's value (either spelling) or append it."""
    out: list[str] = []
    skip = False
    for index, arg in enumerate(args):
        if skip:
            skip = False
            continue
        if arg == f"--{name}" and index + 1 < len(args) and not args[index + 1].startswith("--"):
            skip = True
            continue
        if arg.startswith(f"--{name}="):
            continue
        out.append(arg)
    return [*out, f"--{name}={value}"]


def _free_ports(count: int, avoid: set[int]) -> list[int]:
    """`count` distinct free ports, none in `avoid`. Each is held reserved until all are picked: a port
    released at once can be the kernel's next answer too (Ray refuses two components on one port)."""
    from air.launcher import reserve_port

    picked: list[int] = []
    with contextlib.ExitStack() as held:
        while len(picked) < count:
            reservation = held.enter_context(reserve_port("0.0.0.0"))
            if reservation.port not in avoid and reservation.port not in picked:
                picked.append(reservation.port)
    return picked


def rewrite_start(args: Sequence[str], env: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """The `ray start` arguments air runs instead, and notes for the user (pure: no ports reserved
    here except the free ones it picks)."""
    out = list(args)
    given = _options(out)
    notes: list[str] = []
    head = "head" in given
    head_port = env.get(AIR_RAY_HEAD_PORT)
    # MASTER_PORT is already a port air reserved free on node 0: a command that puts the GCS there
    # (and joins it there) keeps it. Only Ray's fixed defaults (6379) are moved.
    master_port = env.get("MASTER_PORT")
    if head_port:
        if head:
            asked = given.get("port", (0, None))[1]
            if asked not in (head_port, master_port) or asked is None:
                out = _set_option(out, "port", head_port)
                notes.append(f"GCS port {asked or 6379} -> {head_port} ({AIR_RAY_HEAD_PORT}, free on node 0)")
        elif "address" in given and given["address"][1]:
            host, _, port = given["address"][1].rpartition(":")
            master = env.get("MASTER_ADDR")
            if host and host in {master, "127.0.0.1", "localhost"} and port not in (head_port, master_port):
                out = _set_option(out, "address", f"{host}:{head_port}")
                notes.append(f"joining {host}:{head_port} ({AIR_RAY_HEAD_PORT}) instead of port {port}")
    missing = [name for name in _PORT_OPTIONS + (_HEAD_PORT_OPTIONS if head else ()) if name not in given]
    taken = {int(p) for p in (head_port, master_port) if p and p.isdigit()}
    taken |= {int(v) for _, v in given.values() if isinstance(v, str) and v.isdigit()}
    for name, free in zip(missing, _free_ports(len(missing), taken), strict=True):
        out = _set_option(out, name, str(free))
    if "min-worker-port" not in given and "worker-port-list" not in given:
        out = _set_option(out, "min-worker-port", "0")
        out = _set_option(out, "max-worker-port", "0")
    tmpdir = env.get("RAY_TMPDIR")
    if not head and "address" in given and "temp-dir" not in given and tmpdir:
        # A joining node otherwise takes the head's temp dir: two nodes on one host would share one
        # session folder, and both nodes' log monitors would send every worker line twice.
        out = _set_option(out, "temp-dir", str(Path(tmpdir) / "ray"))
    if "disable-usage-stats" not in given:
        out.append("--disable-usage-stats")
    return out, notes


def _marker(env: Mapping[str, str]) -> str:
    tag = env.get(AIR_PROCESS_TAG) or f"pid{os.getppid()}"
    return f"{tag}-ray-node{env.get('NODE_RANK', '0')}"


def _head_alive(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


#: What of a `ray start`'s own output is passed on (it prints a page at most).
_MAX_START_OUTPUT = 1 << 20


def _start(args: Sequence[str]) -> int:
    """`ray start` with air's rewrites, tried again (air.backends.ray_cluster.retry_start, the same retry as
    air's own nodes) when Ray gave up on the node's startup on a busy machine."""
    env = with_patient_waits({k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"})
    marker = _marker(os.environ)
    env[AIR_RAY_NODE] = marker

    def once(attempt: int) -> tuple[int, bool]:
        rewritten, notes = rewrite_start(args, os.environ)  # free ports picked afresh for every try
        if attempt == 1:
            for note in notes:
                print(f"[air] ray start: {note}", flush=True)  # stdout, like ray's (seed 000 hides stderr)
        given = _options(rewritten)
        write_node_info(os.environ, rewritten)
        command = [*_real_ray_start(), "start", *rewritten]
        block, joining = "block" in given, "address" in given and "head" not in given
        if block and joining:
            return _join_blocking(command, env, given, marker), False
        if block:
            # Become the real `ray start`, so `kill $!` of a backgrounded `ray start --head --block &`
            # reaches Ray itself, not a wrapper that dies alone.
            sys.stdout.flush()
            _own_session()
            os.execve(command[0], command, env)
        return _run_watching(command, env)

    return retry_start(once, lambda: stop_marked(marker, grace_s=3.0),
                       lambda note: print(f"[air] ray start: {note}", flush=True))


def _own_session() -> None:
    """Become a session of our own before exec'ing a blocking `ray start` (OWN_SESSION: the kernel then
    schedules Ray's start-up as its own group). A process that already leads its group keeps it."""
    if OWN_SESSION:
        try:
            os.setsid()
        except OSError:
            pass


def _run_watching(command: Sequence[str], env: Mapping[str, str]) -> tuple[int, bool]:
    """Run a `ray start` that returns once its node is up; then pass its output on. Its exit code, and
    whether it failed on Ray's node-startup timeout. The output goes through unlinked files, not pipes:
    the daemons it leaves running inherit them, and a pipe whose reader is gone would end them."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        child = subprocess.Popen(command, env=dict(env), stdout=out, stderr=err, start_new_session=OWN_SESSION)
        _forward_signals_to(child)
        code = child.wait()
        said = b""
        for source, sink in ((out, sys.stdout.buffer), (err, sys.stderr.buffer)):
            source.seek(0)
            text = source.read(_MAX_START_OUTPUT)
            sink.write(text)
            sink.flush()
            said += text
    return code, startup_timed_out(said)


#: What `ray start` prints once its node is registered with the head (Ray 2.x).
_JOINED = b"Ray runtime started"
#: Longer than Ray waits for a starting node to register (its fixed 30 s): a `ray start` still running then joined.
_REGISTER_WAIT_S = 45.0


def _join_blocking(command: Sequence[str], env: Mapping[str, str], given: Mapping[str, tuple[int, str | None]],
                   marker: str) -> int:
    """A joining node with --block: run it, and end it (exit 0) once the head it joined is gone. A head that
    goes away before this node joined it is not one that stopped: its own start may be being tried again (a
    busy machine), and this `ray start` then fails by itself, so the command's own retry joins the new head.
    The output goes through an unlinked file, as in `_run_watching` (the daemons inherit it), read with
    pread so the writers' shared offset is left alone."""
    host, _, port = (given["address"][1] or "").rpartition(":")
    with tempfile.TemporaryFile() as out:
        # Ray's progress lines are on stdout, unbuffered so that its "started" line is read while it blocks
        child = subprocess.Popen(command, env={**env, "PYTHONUNBUFFERED": "1"}, stdout=out,
                                 start_new_session=OWN_SESSION)
        _forward_signals_to(child)
        passed = 0
        seen = b""  # the last bytes read, so a marker cut by a read is still found
        joined = False
        head_seen_at: float | None = None
        misses = 0
        while child.poll() is None:
            time.sleep(1.0)
            new = _pass_on(out.fileno(), passed)
            passed += len(new)
            text, seen = seen + new, (seen + new)[-len(_JOINED):]
            alive = bool(host and port.isdigit() and _head_alive(host, int(port)))
            if alive and head_seen_at is None:
                head_seen_at = time.monotonic()
            # joined: Ray said so, or this `ray start` outlived Ray's own wait for a node to register
            joined = joined or _JOINED in text or (
                head_seen_at is not None and time.monotonic() - head_seen_at > _REGISTER_WAIT_S)
            if joined:
                misses = 0 if alive else misses + 1
            if misses >= 2:
                print("[air] ray start --block: the head node stopped; stopping this node", flush=True)
                stop_marked(marker, grace_s=3.0)
                try:
                    child.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    child.kill()
                _pass_on(out.fileno(), passed)
                return 0
        _pass_on(out.fileno(), passed)
    return child.returncode or 0


def _pass_on(fd: int, offset: int) -> bytes:
    """The output written since `offset` (up to _MAX_START_OUTPUT in all), copied to stdout."""
    new = os.pread(fd, _MAX_START_OUTPUT - offset, offset) if offset < _MAX_START_OUTPUT else b""
    if new:
        sys.stdout.buffer.write(new)
        sys.stdout.flush()
    return new


def _forward_signals_to(child: subprocess.Popen[bytes]) -> None:
    """SIGTERM/SIGINT/SIGHUP to the shim end the `ray start` it runs too (and then the shim)."""
    def forward(signum: int, _frame: object) -> None:
        try:
            child.send_signal(signum)
            child.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            child.kill()
        sys.exit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)


def _stop() -> int:
    count = stop_marked(_marker(os.environ))
    print(f"[air] ray stop: ended this node's Ray ({count} processes); other Ray clusters on this machine "
          "are left alone", flush=True)
    return 0


def main(argv: Sequence[str]) -> int:
    if argv and argv[0] == "start":
        return _start(argv[1:])
    if argv and argv[0] == "stop":
        return _stop()
    real = _real_ray()
    os.execv(real[0], [*real, *argv])
    return 127  # pragma: no cover - execv does not return


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

