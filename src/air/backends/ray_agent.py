"""The node agent: one Ray actor per node of a run, inside that node's placement-group bundle.

It starts the node's processes with the same node launcher as the local backend (`start_processes`),
so process groups, AIR_PROCESS_TAG teardown and log pumping behave identically on every backend. The
submitting side never blocks inside the actor: it long-polls `poll()` and calls `terminate()` from
another thread of this threaded actor.

Lines are written where they are made (the node's own `node.log` beside its process logs) and shipped
as batches: a `poll()` returns once BATCH_INTERVAL_S passed since the first unshipped line, BATCH_BYTES
are buffered, or on an event (every process exited, an error line, a silence change), else after its
`wait_s`. A quiet node costs one call per `wait_s` (several seconds), a chatty one about two a second,
whatever its line rate. If the submitting side falls behind, the oldest unshipped lines are dropped
and counted (`NodePoll.dropped`): the node's log on the submitting side and supervisor.log say so.

While a launch runs, the agent samples its own host for the run's system metrics (CPU, memory, the
node's own GPUs; air.launcher.machine, the reader the local backend's sampler uses too) every
DEFAULT_INTERVAL_S in a small daemon thread, keeping a bounded list of samples that ride on the poll
replies (`NodePoll.samples`, with the node's `host`): no extra calls, and no MLflow on the node.

A *sentinel* process per launch watches the agent: if the agent dies (its raylet was killed, the
driver went away and Ray reaped its actors), the sentinel ends every process carrying the launch's
tag, so a lost node or a dead supervisor leaves no training process holding GPUs behind. (Ray itself
kills only a dying worker's direct children, not a rank's DataLoader workers or a command's children.)

This module imports nothing heavy at import time; `ray` is imported inside the methods that need it.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import io
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from air.backends.base import node_work_root
from air.constants import TERMINATE_GRACE_S
from air.files import atomic_write_bytes
from air.launcher.machine import NodeSampler, Sample
from air.launcher.node import ProcessExit, ProcessSpec
from air.launcher.procs import reap_tag as reap_launch_tag
from air.launcher.procs import tagged_processes
from air.processes import PROCESS_KINDS
from air.settings import AIR_LAUNCHER_PID, AIR_PATH_PREFIX, AIR_PROCESS_TAG, AIR_RAY_NODE

if TYPE_CHECKING:
    from air.launcher.node import Launch
    from air.launcher.ports import PortReservation

#: Separates an attempt's tag from a node's rank in that node's AIR_PROCESS_TAG.
NODE_TAG_SEP = ".node"

#: Lines (and bytes) kept for the submitting side before the oldest are dropped (and counted).
MAX_BUFFERED_LINES = 200_000
MAX_BUFFERED_BYTES = 64 << 20

#: A batch ships at most this long after its first line, or as soon as this many bytes wait.
BATCH_INTERVAL_S = 0.5
BATCH_BYTES = 64 << 10
#: At most this much text per reply (the rest follows in the next call, at once).
MAX_REPLY_BYTES = 8 << 20

#: How often a waiting poll looks at its processes' silences, and how far the submitting side's
#: estimate (last reported silence, aged since) may run ahead of the truth before a poll returns.
SILENCE_CHECK_S = 0.5
SILENCE_SLACK_S = 1.0

#: An error line ships its batch at once, but no sooner than this after the previous reply.
URGENT_GAP_S = 0.1

#: How long the end of a launch waits for the lines its pump still holds to reach the buffer.
OUTPUT_DRAIN_S = 120.0

#: Words that make a line an event: its batch ships at once (the submitting side sees errors promptly).
_ERROR_MARK = re.compile(r"Traceback \(most recent call last\)|Error|ERROR|FATAL")

#: Variables Ray sets for the agent's own worker process that the node's processes must not inherit.
_RAY_PROCESS_ENV = ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "PYTHONBREAKPOINT")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def local_versions() -> dict[str, str | None]:
    """What a pickled call needs to match between caller and nodes (read without importing torch)."""
    import cloudpickle

    return {"python": platform.python_version(), "cloudpickle": cloudpickle.__version__,
            "torch": _version("torch"), "air": _version("air-runtime")}


#: Node-local folder of one node of one run (the same layout the local backend uses).
agent_root = node_work_root


@dataclass(frozen=True)
class NodePoll:
    """What one `poll()` returns: new lines (process index, stream, text), where to resume, and the
    processes' exits once every one of them ended."""

    lines: list[tuple[int, str, str]]
    cursor: int
    dropped: int
    exits: list[ProcessExit] | None
    started: bool
    #: (process index, seconds without progress, stopped?) of each running process, at reply time.
    silences: list[tuple[int, float, bool]] = field(default_factory=list)
    #: The node's complete log, on the node (where dropped lines can still be read).
    node_log: str = ""
    #: This host's system metrics sampled since the previous reply (timestamp ms, metrics), and its hostname.
    samples: list[Sample] = field(default_factory=list)
    host: str = ""
    #: Why this node's system metrics stopped or lack its GPUs ("" if nothing is wrong).
    sampling_problem: str = ""


class NodeAgent:
    """Runs one node's processes for the submitting side (see the module docstring)."""

    def __init__(self, run_id: str, node_rank: int) -> None:
        self.run_id = run_id
        self.node_rank = node_rank
        self.root = agent_root(run_id, node_rank)
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._cond = threading.Condition()
        self._lines: deque[tuple[int, str, str]] = deque()
        self._first = 0  # sequence number of self._lines[0]
        self._bytes = 0  # text bytes (roughly: characters) in self._lines
        self._dropped = 0
        self._oldest_at: float | None = None  # when the first line not yet shipped arrived (monotonic)
        self._urgent = False  # an error line waits: ship it now (but not more often than URGENT_GAP_S)
        self._replied_at = 0.0  # when the last poll returned (monotonic)
        self._counted_to = 0  # lines before this sequence number were shipped or counted as dropped
        self._shipped_to = 0  # the end of the last batch a poll returned
        self._node_log: io.BufferedWriter | None = None  # this node's combined log, on this node
        #: What the last reply said of each process's silence: index → (when it last made progress, stopped?).
        self._reported: dict[int, tuple[float, bool]] = {}
        self._launch: Launch | None = None
        self._thread: threading.Thread | None = None
        self._result: list[ProcessExit] | None = None
        self._stop = threading.Event()
        self._ports: list[PortReservation] = []
        self._sentinel: subprocess.Popen[bytes] | None = None
        self._attempt = 0
        self._ray_tmpdirs: list[Path] = []
        self._sampler: NodeSampler | None = None  # this host's system metrics while a launch runs
        self._host = socket.gethostname()

    # -- what this node is ------------------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        import ray

        context = ray.get_runtime_context()
        return {
            "ip": ray.util.get_node_ip_address(), "node_id": context.get_node_id(), "hostname": socket.gethostname(),
            "pid": os.getpid(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "root": str(self.root),
            "executable": sys.executable, **local_versions(),
        }

    def reserve_ports(self, count: int) -> list[int]:
        """Free ports on this node, held (no other air launch takes them) until the next launch ends."""
        from air.launcher import reserve_port

        for reservation in self._ports:
            reservation.release()
        self._ports = [reserve_port("0.0.0.0") for _ in range(count)]
        return [r.port for r in self._ports]

    # -- code and files ---------------------------------------------------------------------------

    def ray_workload_dirs(self) -> dict[str, str]:
        """This node's `ray` shim folder and a fresh short RAY_TMPDIR, for commands that start Ray by hand."""
        from air.backends.ray_cluster import short_temp_dir
        from air.backends.ray_shim import install_shim

        shim = install_shim(self.root / "bin")
        tmp = short_temp_dir("air-rt")
        self._ray_tmpdirs.append(tmp)
        return {"shim_dir": str(shim), "ray_tmpdir": str(tmp)}

    def has_path(self, path: str) -> bool:
        return Path(path).is_dir()

    def unpack(self, key: str, data: bytes) -> str:
        """Unpack a shipped folder (a tar.gz) once per key; returns where it is on this node."""
        target = self.root.parent / "code" / key
        if target.is_dir():
            return str(target)
        tmp = target.with_name(f".{key}.{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            tar.extractall(tmp, filter="data")
        try:
            os.replace(tmp, target)
        except OSError:  # another agent of the same run on this machine won the race
            shutil.rmtree(tmp, ignore_errors=True)
        return str(target)

    def write_files(self, files: Mapping[str, bytes]) -> str:
        """Write files into this node's work folder (a call's payload); returns the folder."""
        work = self.root / "work"
        work.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            atomic_write_bytes(work / name, data, durable=False)
        return str(work)

    def read_files(self, names: Sequence[str], max_bytes: int | None = None) -> dict[str, bytes | None]:
        """Files of the work folder (rank outcomes), None for those that do not exist or are larger than
        `max_bytes`."""
        out: dict[str, bytes | None] = {}
        for name in names:
            try:
                with open(self.root / "work" / name, "rb") as fh:
                    data = fh.read() if max_bytes is None else fh.read(max_bytes + 1)
                out[name] = None if max_bytes is not None and len(data) > max_bytes else data
            except FileNotFoundError:
                out[name] = None
        return out

    # -- processes --------------------------------------------------------------------------------

    def _node_env(self, task_env: Mapping[str, str]) -> dict[str, str]:
        from air.backends.ray_cluster import clean_ray_env

        env = clean_ray_env(os.environ)
        for key in _RAY_PROCESS_ENV:
            env.pop(key, None)
        env.pop(AIR_PROCESS_TAG, None)
        env.update(task_env)
        prefix = env.pop(AIR_PATH_PREFIX, None)
        if prefix:
            env["PATH"] = prefix + os.pathsep + env.get("PATH", os.defpath)
        return env

    def start(self, procs: Sequence[ProcessSpec], tag: str, grace_s: float = TERMINATE_GRACE_S,
              warm_preload: Sequence[str] | None = None, files: Mapping[str, bytes] | None = None) -> list[int]:
        """Start this node's processes at once (the backend placed them: env and cwd final but for
        NODE_DIR/NODE_PYTHON), after writing `files` (the payload) into the work folder: one call per
        node, so the submitting side starts every node in parallel. Returns their PIDs.

        With `warm_preload` (not None) and where this node can fork, they are forked from one zygote that
        imported those modules once; their PIDs are then not known yet (the forks come a moment later)."""
        from air.launcher import WarmStart, start_processes
        from air.launcher.warm import python_can_fork

        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("this node is still running the previous launch")
        if files:
            self.write_files(files)
        self._attempt += 1
        self._stop.clear()
        self._result = None
        logs = self.root / "logs" / f"launch_{self._attempt}"
        logs.mkdir(parents=True, exist_ok=True)
        with self._cond:
            self._close_node_log()
            self._node_log = open(logs / "node.log", "ab")  # noqa: SIM115 (closed when the launch ends)
            self._reported = {}
        specs = []
        for index, proc in enumerate(procs):  # its secrets (`hide`): masked here, on the node
            spec = proc.on_node(self.root / "work", {AIR_LAUNCHER_PID: str(os.getpid()), **self._node_env(proc.env)},
                                logs / f"proc_{index}.log")
            specs.append(spec if spec.cwd is None or Path(spec.cwd).is_dir() else replace(spec, cwd=None))
        tag = node_tag(tag, self.node_rank)
        self._start_sentinel(tag)
        warm = None
        if warm_preload is not None and python_can_fork():
            warm = WarmStart.for_launch(warm_preload, [spec.env for spec in specs], grace_s=grace_s)
        self._launch = start_processes(specs, on_line=self._on_line, tag=tag, grace_s=grace_s, warm=warm)
        self._start_sampler()
        self._thread = threading.Thread(target=self._wait, name="air-agent-wait", daemon=True)
        self._thread.start()
        return list(self._launch.pids)

    def _start_sampler(self) -> None:
        """Sample this host (its CPU, memory and this agent's own GPUs) while the launch runs."""
        import ray

        self._stop_sampler()
        # (Ray is always connected in an actor; an agent used in-process, as in a unit test, must not start one.)
        gpus = [int(g) for g in ray.get_gpu_ids() if str(g).isdigit()] if ray.is_initialized() else []
        self._sampler = NodeSampler.started(gpus)

    def _stop_sampler(self) -> None:
        """End sampling (one last sample); what it holds still ships with the next replies."""
        if self._sampler is not None:
            self._sampler.stop()

    def _start_sentinel(self, tag: str) -> None:
        # Neither the launch's tag nor the Ray node's marker: stopping either must not stop the sentinel.
        env = {k: v for k, v in os.environ.items() if k not in (AIR_PROCESS_TAG, AIR_RAY_NODE)}
        try:
            self._sentinel = subprocess.Popen(
                PROCESS_KINDS["sentinel"].argv("--detach", tag, str(self.root), *(str(t) for t in self._ray_tmpdirs)), stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True,
                close_fds=True,
            )
        except OSError:
            self._sentinel = None

    def _stop_sentinel(self) -> None:
        sentinel, self._sentinel = self._sentinel, None
        if sentinel is None or sentinel.stdin is None:
            return
        try:
            sentinel.stdin.write(b"done\n")
            sentinel.stdin.close()
        except OSError:
            pass
        try:
            sentinel.wait(timeout=5)  # the first process exits at once (see _sentinel_main); never a zombie
        except subprocess.TimeoutExpired:
            sentinel.kill()

    def node_log_path(self) -> str:
        """Where this node's complete log is, on this node (every line, shipped or dropped)."""
        return str(self.root / "logs" / f"launch_{self._attempt}" / "node.log")

    def _close_node_log(self) -> None:
        log, self._node_log = self._node_log, None
        if log is not None:
            with contextlib.suppress(OSError):
                log.close()

    def _on_line(self, index: int, stream: str, text: str) -> None:
        with self._cond:
            if self._node_log is not None:
                try:
                    self._node_log.write(text.encode("utf-8", errors="replace") + b"\n")
                except OSError:
                    self._close_node_log()
            lines = self._lines
            lines.append((index, stream, text))
            self._bytes += len(text) + 1
            if self._oldest_at is None:
                self._oldest_at = time.monotonic()
            if not self._urgent and _ERROR_MARK.search(text):
                self._urgent = True
            while len(lines) > 1 and (len(lines) > MAX_BUFFERED_LINES or self._bytes > MAX_BUFFERED_BYTES):
                self._bytes -= len(lines.popleft()[2]) + 1
                self._first += 1
            if self._urgent or self._bytes >= BATCH_BYTES:
                self._cond.notify_all()

    def _wait(self) -> None:
        launch = self._launch
        assert launch is not None, "_wait runs on the thread start() begins once it has a launch"
        try:
            result = launch.wait(timeout=None, fail_fast=True, should_stop=self._stop.is_set)
            exits = list(result.exits)
        except BaseException:  # reported to the submitting side as data
            launch.terminate()
            exits = [ProcessExit(i, s.name, -9, time.time(), killed_by_launcher=True, node=s.node, rank=s.rank)
                     for i, s in enumerate(launch.specs)]
        # Every line the pump read reaches the buffer before the exits do (the submitting side stops
        # asking once it has them).
        launch.output_done(timeout=OUTPUT_DRAIN_S)
        for reservation in self._ports:
            reservation.release()
        self._ports = []
        self._stop_sentinel()
        self._stop_sampler()  # its last sample ships with the exits
        with self._cond:
            # Lines dropped after the last batch shipped are noted in the node's own log now, while it is
            # open (the next poll only counts them): the note and the count agree however late that poll is.
            self._count_gap(self._shipped_to)
            self._close_node_log()
            self._result = exits
            self._cond.notify_all()

    def poll(self, cursor: int, wait_s: float = 0.0) -> NodePoll:
        """The next batch of lines from sequence number `cursor` on, and the exits once every process ended.

        Blocks up to `wait_s` until a batch is due (see the module docstring) or an event happens, so a
        quiet node costs one call per `wait_s`. Lines before `cursor` were received by the caller and
        are freed.
        """
        deadline = time.monotonic() + wait_s
        with self._cond:
            self._free(cursor)
            while self._result is None:
                now = time.monotonic()
                remaining = deadline - now
                if remaining <= 0 or self._batch_due(now) or self._silence_changed():
                    break
                due = remaining
                if self._oldest_at is not None:
                    due = min(due, self._oldest_at + BATCH_INTERVAL_S - now)
                if self._urgent:
                    due = min(due, self._replied_at + URGENT_GAP_S - now)
                self._cond.wait(max(min(due, SILENCE_CHECK_S), 0.001))
            self._free(cursor)
            self._count_gap(cursor)
            lines: list[tuple[int, str, str]] = []
            size = 0
            for line in self._lines:
                if size >= MAX_REPLY_BYTES:
                    break
                lines.append(line)
                size += len(line[2]) + 1
            end = self._first + len(lines)
            self._shipped_to = max(self._shipped_to, end)
            complete = len(lines) == len(self._lines)
            if complete:
                self._oldest_at = None
                self._urgent = False
            else:
                self._oldest_at = 0.0  # more is waiting: the next poll returns at once
            if self._node_log is not None:
                with contextlib.suppress(OSError):
                    self._node_log.flush()
            launch = self._launch
            silences = launch.silences() if launch is not None and self._result is None else []
            now_wall = time.time()
            self._reported = {i: (now_wall - silent, stopped) for i, silent, stopped in silences}
            self._replied_at = time.monotonic()
            sampler = self._sampler
            samples = sampler.take() if sampler is not None else []
            # The exits only with the last lines: the submitting side stops asking once it has them.
            return NodePoll(lines, end, self._dropped, self._result if complete else None, launch is not None, silences,
                            self.node_log_path() if self._attempt else "", samples, self._host,
                            sampler.problems() if sampler is not None else "")

    def _free(self, cursor: int) -> None:
        """Forget the lines before `cursor` (the caller has them)."""
        while self._first < cursor and self._lines:
            self._bytes -= len(self._lines.popleft()[2]) + 1
            self._first += 1
        if not self._lines:
            self._bytes = 0
            self._first = max(self._first, cursor)

    def _count_gap(self, cursor: int) -> None:
        """Count the lines the caller (who has everything before `cursor`) will never get: they were
        dropped before being shipped. Counted once, and noted in this node's own log where it happened."""
        start = max(cursor, self._counted_to)
        if self._first > start:
            gap = self._first - start
            self._dropped += gap
            if self._node_log is not None:
                with contextlib.suppress(OSError):
                    self._node_log.write(f"[air] {gap:,} line(s) above were not shipped to the submitting side "
                                         f"(it fell behind); {self._dropped:,} in all; this log has them\n".encode())
        self._counted_to = max(self._counted_to, self._first)

    def _batch_due(self, now: float) -> bool:
        if not self._lines:
            return False
        return ((self._urgent and now - self._replied_at >= URGENT_GAP_S) or self._bytes >= BATCH_BYTES
                or (self._oldest_at is not None and now - self._oldest_at >= BATCH_INTERVAL_S))

    def _silence_changed(self) -> bool:
        """Whether the submitting side's view of silences (the last reply's, aged since) is now wrong by
        more than SILENCE_SLACK_S: a process made progress without a line, stopped or resumed, or ended."""
        launch = self._launch
        if launch is None:
            return False
        now_wall = time.time()
        current = {i: (now_wall - silent, stopped) for i, silent, stopped in launch.silences()}
        if current.keys() != self._reported.keys():
            return True
        for index, (progress_at, stopped) in current.items():
            reported_at, reported_stopped = self._reported[index]
            if stopped != reported_stopped or progress_at - reported_at > SILENCE_SLACK_S:
                return True
        return False

    def stacks(self, index: int) -> str:
        """The Python stacks of process `index` and the Python processes below it (a hang report)."""
        launch = self._launch
        return launch.stacks(index) if launch is not None else "(not started)"

    def terminate(self) -> list[ProcessExit] | None:
        """End this node's processes now (idempotent); returns their exits."""
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout=TERMINATE_GRACE_S * 3 + 30)
        self._stop_sampler()
        with self._cond:
            return self._result

    def reap(self, tag: str) -> int:
        """End leftovers of a launch on this node (a dead supervisor's); returns how many."""
        return reap_tag(tag)

    def cleanup(self) -> None:
        """Drop this node's folder of the run (payloads, node logs, unpacked code)."""
        self.terminate()
        for reservation in self._ports:
            reservation.release()
        shutil.rmtree(self.root, ignore_errors=True)
        for tmp in self._ray_tmpdirs:
            shutil.rmtree(tmp, ignore_errors=True)
        _remove_run_folder(self.root.parent)  # with its unpacked code, once every node of it here is gone

    def ping(self) -> int:
        return os.getpid()


def node_tag(tag: str, node_rank: int) -> str:
    """The AIR_PROCESS_TAG of one node's processes. Each node has its own, so a node's teardown never
    touches another node of the same attempt placed on the same machine; `reap(tag)` covers them all."""
    return f"{tag}{NODE_TAG_SEP}{node_rank}"


def tagged_processes_any_node(tag: str) -> list:
    """Processes of this user tagged `tag` or `node_tag(tag, n)` for any n (read from /proc)."""
    return tagged_processes(tag, subtags=True)


def reap_tag(tag: str) -> int:
    """End every process of this user carrying the tag (any node's); returns how many there were."""
    return reap_launch_tag(tag, subtags=True)


def _sentinel_main(tag: str, folders: Sequence[str]) -> int:
    """Block until the agent closes our stdin: "done" first means a clean end, anything else (EOF
    alone) means the agent died, so the launch's processes are ended and its node folders removed
    (nobody else is left to do it on this node)."""
    data = sys.stdin.buffer.read()
    if data.startswith(b"done"):
        return 0
    reap_tag(tag)
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
    if folders:
        _remove_run_folder(Path(folders[0]).parent)
    return 0


def _remove_run_folder(run_folder: Path) -> None:
    """Remove a run's folder on this node once no node of it is left (only unpacked code remains)."""
    try:
        if not any(p.name.startswith("node_") for p in run_folder.iterdir()):
            shutil.rmtree(run_folder, ignore_errors=True)
    except OSError:
        pass


if __name__ == "__main__":
    args = sys.argv[1:]
    if args and args[0] == "--detach":
        # Ray kills a dying worker's direct children; the sentinel must outlive the agent, so it runs as
        # a grandchild (re-parented to init) holding the same stdin pipe.
        if os.fork() > 0:
            os._exit(0)
        args = args[1:]
    sys.exit(_sentinel_main(args[0], args[1:]))
