"""The node launcher: start N processes, pump their output, wait with fail-fast, end the tree.

It knows nothing of functions, workloads or Ray: a `ProcessSpec` is argv + env + cwd + log file. The
`@distributed` call starts one per rank; a workload node starts one `bash` per node; the Ray backend's
node agent starts either on a remote machine. Every process gets its own session (so a terminal's
Ctrl-C reaches only the launcher, which then tears down in order) and the launch's AIR_PROCESS_TAG.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import BinaryIO, TypeGuard

from air.constants import LAUNCH_POLL_S, TERMINATE_GRACE_S
from air.launcher.cgroups import join_argv
from air.launcher.procs import Waitable, terminate_tree
from air.launcher.progress import HeartbeatSlots, is_stopped
from air.launcher.pump import LineCallback, OutputPump
from air.launcher.redact import Redactor
from air.launcher.sandbox import Sandbox, root_env
from air.launcher.stacks import dump_tree_stacks
from air.launcher.warm import ForkedProcess, WarmStart, Zygote, start_kept, start_zygote
from air.settings import AIR_HEARTBEAT_FILE, AIR_PROCESS_TAG, AIR_STACKS_FILE

#: What the launcher holds for each started process: a Popen (cold start) or a ForkedProcess (warm).
ProcessHandle = subprocess.Popen[bytes] | ForkedProcess


def _started(process: ProcessHandle) -> TypeGuard[Waitable]:
    """Whether teardown can signal it: a forked child's pid arrives later, on the zygote's status pipe."""
    return process.pid is not None


#: Placeholders in a process's argv, env and cwd values that the backend replaces, on the node, with that
#: node's work folder (where `NodeLaunch.files` are put) and with the node's Python (`ProcessSpec.on_node`).
NODE_DIR = "@AIR_NODE_DIR@"
NODE_PYTHON = "@AIR_NODE_PYTHON@"


@dataclass(frozen=True)
class ProcessSpec:
    """One process to start, from the run controller to the node launcher. `name` is how logs and errors
    call it ("rank 3", "node 1"); `node` and `rank` where it sits in the run (`rank`: a call's global rank,
    None for a workload's node command). `hide`: secret values it was given, masked in its output before
    any line is written (see redact.py).

    As the controller plans it, `log_path` may be None (the node's log only) and values may hold NODE_DIR
    and NODE_PYTHON; the backend adds what only placement decides (MASTER_ADDR, MASTER_PORT,
    CUDA_VISIBLE_DEVICES) and `on_node` makes it final where it runs."""

    name: str
    argv: Sequence[str]
    env: dict[str, str]
    log_path: Path | None = None
    cwd: Path | str | None = None
    hide: tuple[str, ...] = ()
    #: Run it walled in (launcher/sandbox.py): a filesystem view, as another account where one is given.
    sandbox: Sandbox | None = None
    node: int = 0
    rank: int | None = None
    #: A file the process writes in the node's work folder once its work is done (a rank's result is
    #: reported): however it ends after that is not a failure, so it does not end the other processes.
    done_file: str | None = None

    def on_node(self, work: Path, env: dict[str, str], log_path: Path, *, cwd: Path | str | None = None,
                sandbox: Sandbox | None = None) -> ProcessSpec:
        """This process as it starts on a node whose work folder is `work`: `env` (the node's and its own,
        merged by the backend), its log, and NODE_DIR/NODE_PYTHON replaced in argv, env and cwd."""
        def expand(value: str) -> str:
            return value.replace(NODE_DIR, str(work)).replace(NODE_PYTHON, sys.executable)

        cwd = cwd or self.cwd
        return replace(self, argv=[expand(a) for a in self.argv], env={k: expand(v) for k, v in env.items()},
                       log_path=log_path, cwd=Path(expand(str(cwd))) if cwd else None, sandbox=sandbox)


@dataclass(frozen=True)
class ProcessExit:
    """How one process ended: exit code (None while running) or the signal that killed it. `index`: its
    place among its node's processes; `node` and `rank` as its ProcessSpec says."""

    index: int
    name: str
    returncode: int | None
    ended_at: float | None
    killed_by_launcher: bool = False
    node: int = 0
    rank: int | None = None

    @property
    def signal_name(self) -> str | None:
        if self.returncode is not None and self.returncode < 0:
            try:
                return signal.Signals(-self.returncode).name
            except ValueError:
                return f"signal {-self.returncode}"
        return None

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def describe(self) -> str:
        if self.returncode is None:
            return "still running"
        if self.signal_name:
            return f"killed by {self.signal_name}"
        return f"exit code {self.returncode}"


@dataclass
class LaunchResult:
    """What `wait()` saw: every exit, the first failure (if any) and whether the deadline hit."""

    exits: list[ProcessExit]
    first_failure: ProcessExit | None
    timed_out: bool = False
    interrupted: bool = False

    @property
    def ok(self) -> bool:
        return self.first_failure is None and not self.timed_out and not self.interrupted


class Launch:
    """Processes started together; ended together. Use `start_processes()` to make one."""

    def __init__(self, specs: Sequence[ProcessSpec], *, on_line: LineCallback | None, tag: str,
                 grace_s: float, warm: WarmStart | None = None) -> None:
        unlogged = [spec.name for spec in specs if spec.log_path is None]
        if unlogged:  # before anything is opened or started
            raise ValueError(f"No log file for {', '.join(unlogged)}: a backend gives one (ProcessSpec.on_node).")
        self.specs = list(specs)
        self.tag = tag
        self.grace_s = grace_s
        self.warm = warm
        self._on_line = on_line
        self.popens: list[ProcessHandle] = []
        self.zygote: Zygote | None = None
        self._logs: list[BinaryIO] = []
        self._ended_at: dict[int, float] = {}
        self._running_at_teardown: set[int] | None = None
        self._terminated = False
        self.started_at = time.time()
        #: Progress per process: the time of its last line (noted here) or heartbeat (its slot).
        self._last_line = [0.0] * len(self.specs)
        self._heartbeats = HeartbeatSlots(len(self.specs))
        self._pump = OutputPump(on_line, on_output=self._noted)
        self._redactors = [Redactor(spec.hide) if spec.hide else None for spec in self.specs]

    def _noted(self, index: int) -> None:
        """Process `index` wrote output (once per block the pump reads, not per line)."""
        self._last_line[index] = time.time()

    def _env(self, index: int) -> dict[str, str]:
        """Spec `index`'s environment with what the launch adds: its tag and heartbeat slot."""
        slot = self._heartbeats.paths[index]
        return {**self.specs[index].env, AIR_PROCESS_TAG: self.tag, AIR_HEARTBEAT_FILE: slot,
                AIR_STACKS_FILE: slot + ".stacks"}

    def stacks(self, index: int) -> str:
        """The Python stacks of process `index` and of every Python process it started (see stacks.py)."""
        return dump_tree_stacks(self.popens[index].pid, self._heartbeats.paths[index] + ".stacks")

    def last_progress(self, index: int) -> float:
        """Wall-clock time of process `index`'s last line or heartbeat (its start if neither yet; a forked
        process starts when it is forked, not while the zygote imported what it preloads)."""
        popen = self.popens[index] if index < len(self.popens) else None
        began = popen.started_at if isinstance(popen, ForkedProcess) and popen.started_at else self.started_at
        return max(began, self._last_line[index], self._heartbeats.read(index))

    def silences(self, now: float | None = None) -> list[tuple[int, float, bool]]:
        """(index, seconds without progress, stopped?) of every process still running. A process the zygote
        has not forked yet is not silent, it does not exist: a zygote stuck importing is the call's
        timeout's to end, not a hang of the rank."""
        now = time.time() if now is None else now
        out = []
        for index, popen in enumerate(self.popens):
            if isinstance(popen, ForkedProcess) and popen.pid is None:
                continue
            if popen.poll() is None:
                out.append((index, max(now - self.last_progress(index), 0.0), is_stopped(popen.pid)))
        return out

    def _open_logs(self) -> None:
        for spec in self.specs:
            assert spec.log_path is not None  # checked in __init__
            spec.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._logs.append(open(spec.log_path, "ab", buffering=0))  # closed in terminate

    def _sandbox(self, spec: ProcessSpec) -> Sandbox | None:
        """The spec's sandbox, which may also write the launch's heartbeat slots; its folders made ready."""
        if spec.sandbox is None:
            return None
        sandbox = replace(spec.sandbox, writable=(*spec.sandbox.writable, self._heartbeats.folder))
        sandbox.prepare()
        return sandbox

    def _start_warm(self, warm: WarmStart) -> None:
        """Every process forked by one zygote that imported `warm.preload` once (see warm.py)."""
        self._open_logs()
        envs = [self._env(index) for index in range(len(self.specs))]
        argvs = [spec.argv for spec in self.specs]
        cwds = [str(spec.cwd) if spec.cwd else None for spec in self.specs]
        # One zygote forks them all: one view for the launch, writing what any of its specs may write
        # (each node's work folder of a multi-node call on this machine).
        first = self.specs[0].sandbox
        union = None if first is None else replace(first, writable=tuple(dict.fromkeys(
            path for spec in self.specs if spec.sandbox is not None for path in spec.sandbox.writable)))
        sandbox = self._sandbox(replace(self.specs[0], sandbox=union))
        if sandbox is not None:
            warm = replace(warm, sandbox=sandbox, keep=False)  # a kept zygote would outlive the launch's view
        zygote = start_kept(warm, argvs, envs, cwds, self.tag) if warm.keep else None
        if zygote is None:
            zygote = start_zygote(warm, argvs, envs, cwds)
        self.zygote = zygote
        self.popens = list(zygote.handles)
        for index, stream, pipe in zygote.pipes:
            self._pump.add(index, stream, pipe, self._logs[index], self._redactors[index])
        self._pump.add_control(zygote.status, zygote.on_status, zygote.on_status_closed)

    def _start_cold(self) -> None:
        """Every process its own interpreter, a direct child of this one."""
        self._open_logs()
        for index, (spec, log) in enumerate(zip(self.specs, self._logs, strict=True)):
            sandbox = self._sandbox(spec)
            env = self._env(index)  # (root starts a walled one: its loader's variables come after the switch)
            argv = list(spec.argv) if sandbox is None else join_argv(sandbox.cgroup, sandbox.wrap(
                spec.argv, cwd=str(spec.cwd or ""), env=env))
            popen = subprocess.Popen(
                argv, env=env if sandbox is None else root_env(env), cwd=spec.cwd,
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                close_fds=True,
            )
            self.popens.append(popen)
            assert popen.stdout is not None and popen.stderr is not None
            self._pump.add(index, "stdout", popen.stdout, log, self._redactors[index])
            self._pump.add(index, "stderr", popen.stderr, log, self._redactors[index])
            self._pump.watch_exit(index, popen.pid, self._record_exit)

    def _start(self) -> None:
        try:
            if self.warm is not None:
                self._start_warm(self.warm)
            else:
                self._start_cold()
        except BaseException:
            self.terminate()
            raise
        self._pump.start()

    def _record_exit(self, index: int, when: float) -> None:
        self._ended_at.setdefault(index, when)

    @property
    def pids(self) -> list[int]:
        """PIDs of the started processes (a warm start's children appear once forked)."""
        return [p.pid for p in self.popens if p.pid is not None]

    def poll(self) -> list[ProcessExit]:
        now = time.time()
        exits = []
        for index, popen in enumerate(self.popens):
            code = popen.poll()
            if code is not None and index not in self._ended_at:
                ended = popen.ended_at if isinstance(popen, ForkedProcess) else None
                self._ended_at[index] = ended or now
            killed = self._running_at_teardown is not None and index in self._running_at_teardown
            spec = self.specs[index]
            exits.append(ProcessExit(index, spec.name, code, self._ended_at.get(index), killed_by_launcher=killed,
                                     node=spec.node, rank=spec.rank))
        return exits

    def wait(self, *, timeout: float | None = None, fail_fast: bool = True,
             should_stop: Callable[[], bool] | None = None, poll_s: float = LAUNCH_POLL_S,
             is_failure: Callable[[ProcessExit], bool] | None = None) -> LaunchResult:
        """Block until all processes end, one fails (fail_fast), the timeout passes or `should_stop()`.

        In every case but a clean success of all, the whole tree is ended before this returns. A
        KeyboardInterrupt also ends the tree, then propagates. `is_failure` can excuse a non-zero exit
        (a rank that reported its result, then crashed on the way out, failed nothing).
        """
        verdicts: dict[int, bool] = {}  # an exit is final, so is its verdict: asked once per process

        def failing(e: ProcessExit) -> bool:
            if e.returncode in (None, 0):
                return False
            if e.index not in verdicts:
                verdicts[e.index] = is_failure is None or is_failure(e)
            return verdicts[e.index]

        deadline = None if timeout is None else time.monotonic() + timeout
        first_failure: ProcessExit | None = None
        timed_out = interrupted = False
        try:
            while True:
                exits = self.poll()
                failed = sorted((e for e in exits if failing(e)), key=lambda e: e.ended_at or float("inf"))
                if failed and first_failure is None:
                    first_failure = failed[0]
                if all(e.returncode is not None for e in exits) or (fail_fast and first_failure):
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    timed_out = True
                    break
                if should_stop is not None and should_stop():
                    interrupted = True
                    break
                time.sleep(poll_s)
        except BaseException:
            self.terminate()
            raise
        self.terminate()
        exits = self.poll()
        if first_failure is None and not timed_out and not interrupted:
            failed = sorted((e for e in exits if failing(e) and not e.killed_by_launcher),
                            key=lambda e: e.ended_at or float("inf"))
            first_failure = failed[0] if failed else None
        return LaunchResult(exits, first_failure, timed_out, interrupted)

    def _pump_catching_up(self, idle_s: float = 2.0, limit_s: float = 60.0) -> bool:
        """Let a pump still busy with what the processes wrote before they ended (a fast writer leaves
        megabytes in its pipes, handed to `on_line` line by line) finish; False once it handled nothing
        for `idle_s` (a stray process holds a pipe open: stop it) or after `limit_s`."""
        deadline = time.monotonic() + limit_s
        seen = -1
        while self._pump.handled != seen and time.monotonic() < deadline:
            seen = self._pump.handled
            if self._pump.join(timeout=idle_s):
                return True
        return False

    def output_done(self, timeout: float | None = None) -> bool:
        """Wait until every line read from the pipes was handed to `on_line` (after `wait`, the pump may
        still be on a big last block); False if it is still busy after `timeout`."""
        return self._pump.join(timeout)

    def terminate(self) -> list[int]:
        """End every process of the launch and all their descendants; then flush the logs. Idempotent."""
        if not self.popens and not self._logs:
            self._heartbeats.close()
            return []
        if self._running_at_teardown is None:
            self._running_at_teardown = {i for i, p in enumerate(self.popens) if p.poll() is None}
        children: list[Waitable] = [p for p in self.popens if _started(p)]
        if self.zygote is not None and all(p.poll() is not None for p in self.popens):
            try:  # every child reported: the zygote leaves by itself in a moment
                self.zygote.popen.wait(timeout=self.grace_s)
            except subprocess.TimeoutExpired:
                pass
        if self.zygote is not None:
            ending = self.zygote.for_teardown()
            if ending is not None and _started(ending):  # for_teardown returns no leader without a pid
                children.append(ending)  # it forwards SIGTERM to its children and reaps them
        killed = terminate_tree(children, tag=self.tag, grace_s=self.grace_s)
        if not self._pump.join(timeout=2.0) and not self._pump_catching_up():
            self._pump.stop()
        if self.zygote is not None:
            self.zygote.on_status_closed()  # children whose exit it never reported
        self.poll()
        if not self._terminated:
            self._terminated = True
            for log in self._logs:
                log.close()
            self._heartbeats.close()
        return killed


def start_processes(specs: Sequence[ProcessSpec], *, on_line: LineCallback | None = None,
                    tag: str | None = None, grace_s: float = TERMINATE_GRACE_S,
                    warm: WarmStart | None = None) -> Launch:
    """Start every spec at once, each in its own session, all tagged for teardown.

    With `warm`, every spec (`python -m MODULE ...`) is forked from one zygote that imported
    `warm.preload` once, instead of started as its own interpreter (see warm.py).
    """
    launch = Launch(specs, on_line=on_line, tag=tag or f"launch-{uuid.uuid4().hex[:12]}", grace_s=grace_s,
                    warm=warm)
    launch._start()
    return launch


def read_tail(path: Path, lines: int) -> str:
    """The last `lines` lines of a log (for error messages); reads only the end of the file."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(size - 64 * 1024, 0))
            data = fh.read()
    except OSError:
        return ""
    return "\n".join(data.decode("utf-8", errors="replace").splitlines()[-lines:])
