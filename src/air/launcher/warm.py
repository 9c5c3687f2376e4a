"""Warm start: the processes of a launch forked from one process that imported the heavy modules once.

Every rank of a `@distributed` call is `python -m air.distributed.worker CALL_DIR` with its own
environment. Started cold, each pays an interpreter start and its own `import torch` (1-3 s, all ranks
at once, contending for the same cores and disk), and the first rank to reach `init_process_group`
waits for rank 0 to open the rendezvous store. Started warm, one zygote (zygote.py) imports torch once,
forks every rank in milliseconds, and hosts the store, as torchrun's agent does. The ranks are the same
processes in every other respect: own session, own pipes and log, own environment, same teardown.

Warm calls (`WarmStart.keep`): a notebook calling `.distributed()` again and again gets the same zygote
for every launch with the same python, preload, sys.path, cwd, world size and environment, so later
launches skip the import altogether. The kept zygote forks one leader per launch (serve() in zygote.py),
which does what a one-shot zygote does for it; it ends with the caller (pdeathsig, atexit, the control
socket's end), after AIR_WARM_IDLE_S without a launch, or when a launch needs another one.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, BinaryIO

import psutil

from air.constants import LEADER_EXIT_WAIT_S, float_env
from air.launcher.cgroups import join_argv
from air.launcher.sandbox import Sandbox, root_env
from air.processes import PROCESS_KINDS
from air.settings import (
    AIR_HEARTBEAT_FILE,
    AIR_LAUNCHER_PID,
    AIR_PROCESS_TAG,
    AIR_STACKS_FILE,
    AIR_WARM_IDLE_S,
)

#: Environment keys a forked child sets for itself (never inherited from the zygote's environment).
_PER_CHILD = (AIR_LAUNCHER_PID,)

#: Seconds a zygote kept between launches waits for the next one before it leaves; 0 keeps none.
WARM_IDLE_ENV = AIR_WARM_IDLE_S


def warm_idle_s() -> float:
    """How long a kept zygote waits for the next launch (AIR_WARM_IDLE_S, default 10 minutes)."""
    return max(float_env(WARM_IDLE_ENV, 600.0), 0.0)


@dataclass(frozen=True)
class WarmStart:
    """How to start a launch warm. Every spec's argv must be `[python, "-m", module, *args]`.

    `preload`: modules the zygote imports before forking. `store`: host the c10d TCPStore of a
    torch.distributed rendezvous on 127.0.0.1:`store_port` for `world_size` ranks (needs torch preloaded).
    `keep`: keep the zygote for this caller's next launch (warm calls); `call_env`: the environment keys
    that change from one launch to the next (ports, folders), left out of a kept zygote's environment.
    """

    python: str
    preload: tuple[str, ...] = ()
    sys_path: tuple[str, ...] = ()
    store_port: int | None = None
    world_size: int = 0
    grace_s: float = 1.0
    timeout_s: float = 1800.0
    keep: bool = False
    call_env: tuple[str, ...] = ()
    #: The zygote (and so every child it forks) runs walled in (launcher/sandbox.py).
    sandbox: Sandbox | None = None

    @classmethod
    def for_launch(cls, preload: Sequence[str], envs: Sequence[Mapping[str, str]], *, grace_s: float,
                   store_port: int | None = None, keep: bool = False) -> WarmStart:
        """The one way a launch's warm start is made: this Python and sys.path, one fork per env in
        `envs`; with torch preloaded and a `store_port`, the zygote hosts the rendezvous store there (as
        torchrun's agent does, so no rank waits for rank 0 to open it). With `keep`, what the launch sets
        (its keys that differ from this process's environment: ports, folders, ranks) is its `call_env`,
        left out of the kept zygote's environment. Only `preload` (well-known third-party modules) is
        ever imported there, so a user module edited between calls is imported afresh by the ranks."""
        preload = tuple(preload)
        call_env = tuple(sorted(k for k, v in envs[0].items() if os.environ.get(k) != v)) if keep and envs else ()
        return cls(python=sys.executable, preload=preload, sys_path=tuple(p for p in sys.path if p),
                   store_port=store_port if "torch" in preload else None, world_size=len(envs), grace_s=grace_s,
                   keep=keep, call_env=call_env)

    def module_of(self, argv: Sequence[str]) -> tuple[str, list[str]]:
        if len(argv) < 3 or argv[0] != self.python or argv[1] != "-m":
            raise ValueError(f"a warm start runs `{self.python} -m MODULE ...`, not {list(argv)[:3]}")
        return argv[2], list(argv[3:])


class ForkedProcess:
    """A process the zygote forked: what `Popen` offers the launcher (pid, poll, wait, returncode).

    Its pid and exit status arrive on the zygote's status pipe; until then it counts as running.
    """

    def __init__(self, index: int) -> None:
        self.index = index
        self.pid: int | None = None
        self.returncode: int | None = None
        self.ended_at: float | None = None
        #: When it was forked (wall clock): a hang clock starts here, not while the zygote imported.
        self.started_at: float | None = None
        self._done = threading.Event()

    def started(self, pid: int) -> None:
        self.pid = pid
        self.started_at = time.time()

    def ended(self, returncode: int, when: float) -> None:
        if self.returncode is None:
            self.returncode, self.ended_at = returncode, when
            self._done.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(f"forked process {self.index}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def __repr__(self) -> str:
        return f"ForkedProcess(index={self.index}, pid={self.pid}, returncode={self.returncode})"


class LeaderHandle(ForkedProcess):
    """The process a kept zygote forked to run one launch: its pid comes on the launch's status pipe
    (`leader`), its exit code just before it leaves (`done`); the pipe's end means it is gone."""

    def __init__(self, kept: KeptZygote) -> None:
        super().__init__(-1)
        self.kept = kept
        self.done_code: int | None = None
        self._closing = threading.Lock()  # the pump and the launcher's teardown may both get here

    def closed(self) -> None:
        """The status pipe ended: the leader is gone, or the zygote died before forking it."""
        with self._closing:
            if self.returncode is not None:
                return
            if self.pid is None:
                code = self.kept.exit_code(timeout=5)
                self.ended(code if code is not None else -signal.SIGKILL, time.time())
            else:
                # The pipe closes as the leader's exit closes its files, a moment before it stops running
                # (tearing down a large address space first): a launch is over when its leader is gone.
                deadline = time.monotonic() + LEADER_EXIT_WAIT_S
                while _alive(self.pid) and time.monotonic() < deadline:
                    time.sleep(0.005)
                self.ended(self.done_code if self.done_code is not None else -signal.SIGKILL, time.time())
            self.kept.finished()


def common_env(envs: Sequence[dict[str, str]]) -> dict[str, str]:
    """What every process's environment shares: the zygote's own (what native libraries read at import)."""
    shared = dict(envs[0])
    for env in envs[1:]:
        shared = {k: v for k, v in shared.items() if env.get(k) == v}
    for key in _PER_CHILD:
        shared.pop(key, None)
    return shared


@dataclass
class Zygote:
    """The started zygote, the handles of its children, and the pipes the launcher must read."""

    popen: subprocess.Popen[bytes] | LeaderHandle  # the one-shot zygote, or a kept one's leader
    handles: list[ForkedProcess]
    pipes: list[tuple[int, str, IO[bytes]]]  # (index, stream, read end) per child, plus the zygote's own as 0
    status: BinaryIO
    notes: list[str] = field(default_factory=list)

    def on_status(self, line: str) -> None:
        """One line from the zygote (pump thread): a child's pid, its exit, or a note."""
        kind, _, rest = line.partition(" ")
        parts = rest.split()
        try:
            if kind == "start":
                self.handles[int(parts[0])].started(int(parts[1]))
            elif kind == "exit":
                self.handles[int(parts[0])].ended(int(parts[1]), float(parts[2]))
            elif kind == "note":
                self.notes.append(rest)
            elif kind == "leader" and isinstance(self.popen, LeaderHandle):
                self.popen.started(int(parts[0]))
            elif kind == "done" and isinstance(self.popen, LeaderHandle):
                self.popen.done_code = int(parts[0])
        except (IndexError, ValueError):
            self.notes.append(f"unreadable status line: {line!r}")

    def on_status_closed(self) -> None:
        """The zygote is gone: any child whose exit it did not report ended with it (killed)."""
        if isinstance(self.popen, LeaderHandle):
            self.popen.closed()
            code = self.popen.returncode
        else:
            try:
                code = self.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                code = None
        now = time.time()
        for handle in self.handles:
            if handle.returncode is not None or _alive(handle.pid):
                continue
            never_forked = handle.pid is None
            # Never forked: it failed as the zygote did. Forked, exit unreported: ended with it (killed).
            handle.ended(code if never_forked and code else -signal.SIGKILL, now)


    def for_teardown(self) -> subprocess.Popen[bytes] | LeaderHandle | None:
        """What the launcher ends besides the children: the one-shot zygote, or a kept one's leader. A
        leader not heard of yet may be forking right now: the kept zygote is ended instead (and with it
        whatever it forked for this launch)."""
        popen = self.popen
        if isinstance(popen, LeaderHandle) and popen.pid is None:
            if popen.returncode is None:
                popen.kept.end()
            return None
        return popen


def _alive(pid: int | None) -> bool:
    """Running (a zombie is not: it holds nothing and runs nothing)."""
    if pid is None:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def start_zygote(warm: WarmStart, argvs: Sequence[Sequence[str]], envs: Sequence[dict[str, str]],
                 cwds: Sequence[str | None]) -> Zygote:
    """Start the zygote with its plan; return at once (the forks happen while the caller goes on)."""
    modules = [warm.module_of(argv) for argv in argvs]
    shared = common_env(envs)
    opened: list[int] = []
    try:
        out_pipes = [os.pipe() for _ in argvs]
        err_pipes = [os.pipe() for _ in argvs]
        status_r, status_w = os.pipe()
        plan_r, plan_w = os.pipe()
        opened = [fd for pair in (*out_pipes, *err_pipes, (status_r, status_w), (plan_r, plan_w)) for fd in pair]
        procs = proc_plans(modules, envs, cwds, shared, [w for _, w in out_pipes], [w for _, w in err_pipes])
        plan = {"preload": list(warm.preload), "sys_path": list(warm.sys_path), "procs": procs,
                "grace_s": warm.grace_s, "store": store_plan(warm)}
        passed = [status_w, plan_r, *[w for _, w in out_pipes], *[w for _, w in err_pipes]]
        argv = PROCESS_KINDS["zygote"].argv(str(plan_r), str(status_w), python=warm.python)
        if warm.sandbox is not None:  # (root starts it: its loader's variables come after the switch)
            argv = join_argv(warm.sandbox.cgroup, warm.sandbox.wrap(argv, cwd=cwds[0], env=shared))
        popen = subprocess.Popen(
            argv, env=shared if warm.sandbox is None else root_env(shared), cwd=cwds[0],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
            pass_fds=passed,
        )
    except BaseException:
        for fd in opened:
            try:
                os.close(fd)
            except OSError:
                pass
        raise
    for fd in passed:
        os.close(fd)
    data = json.dumps(plan).encode()
    try:
        with os.fdopen(plan_w, "wb") as fh:  # small: the shared environment went through Popen
            fh.write(data)
    except BrokenPipeError:
        pass  # the zygote died at once; its stderr and exit code say why
    assert popen.stdout is not None and popen.stderr is not None
    pipes = read_ends(out_pipes, err_pipes) + [(0, "stdout", popen.stdout), (0, "stderr", popen.stderr)]
    return Zygote(popen, [ForkedProcess(i) for i in range(len(argvs))], pipes,
                  os.fdopen(status_r, "rb", buffering=0))


def proc_plans(modules: Sequence[tuple[str, list[str]]], envs: Sequence[dict[str, str]],
               cwds: Sequence[str | None], shared: dict[str, str], outs: Sequence[int],
               errs: Sequence[int]) -> list[dict[str, object]]:
    """What the zygote forks: per process its module, args, cwd, environment beyond `shared` (and what of
    `shared` it unsets), and the descriptors of its stdout and stderr."""
    return [{"module": module, "args": args, "cwd": cwd, "out": out, "err": err,
             "env": {k: v for k, v in env.items() if shared.get(k) != v}, "unset": [k for k in shared if k not in env]}
            for (module, args), env, cwd, out, err in zip(modules, envs, cwds, outs, errs, strict=True)]


def store_plan(warm: WarmStart) -> dict[str, object] | None:
    """The rendezvous store the zygote hosts for the launch, if any (see zygote.py)."""
    if warm.store_port is None:
        return None
    return {"host": "127.0.0.1", "port": warm.store_port, "world_size": warm.world_size,
            "timeout_s": warm.timeout_s}


def read_ends(out_pipes: Sequence[tuple[int, int]],
              err_pipes: Sequence[tuple[int, int]]) -> list[tuple[int, str, IO[bytes]]]:
    """(index, stream, read end) of every child's stdout and stderr pipe, for the launcher's pumps."""
    pipes: list[tuple[int, str, IO[bytes]]] = []
    for index, (out, err) in enumerate(zip(out_pipes, err_pipes, strict=True)):
        pipes.append((index, "stdout", os.fdopen(out[0], "rb", buffering=0)))
        pipes.append((index, "stderr", os.fdopen(err[0], "rb", buffering=0)))
    return pipes


def python_can_fork() -> bool:
    """Warm starts fork, and their children's teardown relies on Linux (pdeathsig, /proc)."""
    return hasattr(os, "fork") and sys.platform.startswith("linux")


# ---- warm calls: a caller's zygote kept between its launches ---------------------------------------

_MAX_FDS = 250  # SCM_RIGHTS takes at most 253 descriptors per message
_MAX_PLAN = 128 * 1024  # within a SOCK_SEQPACKET message's default limit


class KeptZygote:
    """A zygote kept between the launches of this caller (see serve() in zygote.py) and how to reach it."""

    def __init__(self, key: tuple[object, ...], popen: subprocess.Popen[bytes], sock: socket.socket,
                 grace_s: float, env: dict[str, str]) -> None:
        self.key = key
        #: Its own environment: what every launch's processes inherit, less what each plan unsets.
        self.env = env
        #: Started before its first launch was ready (prestart_kept): that launch adopts it.
        self.provisional = False
        self.popen = popen
        self.sock = sock
        self.grace_s = grace_s
        self.ready = False  # it said it is done preloading (and may now leave when idle)
        self._unacked = 0
        self._own_pipes: list[tuple[int, str, IO[bytes]]] | None = None
        self._lock = threading.Lock()
        self._ended = False
        self.in_flight = 0  # launches handed to it whose leader has not ended yet

    @classmethod
    def start(cls, warm: WarmStart, key: tuple[object, ...], env: dict[str, str], modules: Sequence[str],
              cwd: str | None) -> KeptZygote:
        """Start it from a thread of its own that lives as long as it does: pdeathsig fires when the
        thread that started a process ends, and the calling thread may end long before the caller."""
        from air.launcher.zygote import TAG_SLOT_ENV, TAG_SLOT_LEN  # not at import: `-m` runs that module

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        started: dict[str, object] = {}
        ready = threading.Event()

        def hold() -> None:
            try:
                started["popen"] = subprocess.Popen(
                    PROCESS_KINDS["kept_zygote"].argv("keep", str(theirs.fileno()), python=warm.python),
                    env={**env, TAG_SLOT_ENV: "x" * TAG_SLOT_LEN}, cwd=cwd, stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                    pass_fds=[theirs.fileno()])
            except BaseException as exc:  # raised in the caller below
                started["error"] = exc
            finally:
                ready.set()
            popen = started.get("popen")
            if isinstance(popen, subprocess.Popen):
                popen.wait()

        threading.Thread(target=hold, name="air-warm-zygote", daemon=True).start()
        ready.wait()
        theirs.close()
        if "error" in started:
            ours.close()
            raise started["error"]  # type: ignore[misc]
        popen = started["popen"]
        assert isinstance(popen, subprocess.Popen) and popen.stdout is not None and popen.stderr is not None
        kept = cls(key, popen, ours, warm.grace_s, dict(env))
        # What it writes while preloading goes to the first launch's first log (as a one-shot zygote's).
        kept._own_pipes = [(0, "stdout", popen.stdout), (0, "stderr", popen.stderr)]
        setup = {"preload": list(warm.preload), "sys_path": list(warm.sys_path), "modules": list(modules),
                 "idle_s": warm_idle_s(), "grace_s": warm.grace_s}
        ours.send(json.dumps(setup).encode())
        return kept

    def alive(self) -> bool:
        return not self._ended and self.popen.poll() is None

    def finished(self) -> None:
        """One launch's leader ended (or never started)."""
        with self._lock:
            self.in_flight = max(self.in_flight - 1, 0)

    def own_pipes(self) -> list[tuple[int, str, IO[bytes]]]:
        """Its stdout/stderr, for the first launch only (it points them at /dev/null once preloaded)."""
        pipes, self._own_pipes = self._own_pipes or [], None
        return pipes

    def submit(self, data: bytes, fds: Sequence[int]) -> bool:
        """Hand it a launch's plan and pipes. False if it is gone (it may have just left, idle): then
        nothing of the launch runs there, and the caller starts another zygote."""
        with self._lock:
            if not self.alive():
                return False
            try:
                self._read(until_acked=False)
                self.sock.settimeout(10.0)
                socket.send_fds(self.sock, [data], list(fds))
                self._unacked += 1
                self.in_flight += 1
                if self.ready:  # it answers at once; no answer: it left before it took the plan
                    self._read(until_acked=True)
            except OSError:
                self.end()
                return False
        return True

    def _read(self, *, until_acked: bool) -> None:
        deadline = time.monotonic() + 10.0
        while not (until_acked and self._unacked == 0):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("a kept zygote did not answer")
            self.sock.settimeout(remaining if until_acked else 0.0)
            try:
                message = self.sock.recv(64)
            except (TimeoutError, BlockingIOError):
                if until_acked:
                    raise
                return
            if not message:
                raise ConnectionResetError("a kept zygote closed its socket")
            if message == b"ready":
                self.ready = True
            elif message == b"k":
                self._unacked -= 1

    def exit_code(self, timeout: float) -> int | None:
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def end(self) -> None:
        """SIGTERM (a running launch's leader then ends its launch), SIGKILL after the grace; wait."""
        self._ended = True
        if self.popen.poll() is None:
            try:
                self.popen.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
            if self.exit_code(timeout=3 * self.grace_s + 2) is None:
                self.popen.kill()
                self.exit_code(timeout=5)
        self.sock.close()


class _KeptZygotes:
    """This caller's kept zygote (one at a time: a launch that needs another ends it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: KeptZygote | None = None
        self._owner = os.getpid()
        atexit.register(self.shutdown)

    def get(self, warm: WarmStart, key: tuple[object, ...], env: dict[str, str], modules: Sequence[str],
            cwd: str | None) -> KeptZygote | None:
        """The kept zygote for `key`: the current one, or a new one that replaces it (None: the current
        one is of another key and busy)."""
        with self._lock:
            kept = self._own()
            if kept is not None and kept.provisional and kept.alive() and _adoptable(kept, key, env):
                kept.key, kept.provisional = key, False
                return kept
            if kept is not None and kept.key != key and kept.alive() and kept.in_flight:
                return None  # another call of this caller runs on it right now: this one goes one-shot
            if kept is not None and (kept.key != key or not kept.alive()):
                self._kept = None
                kept.end()
                kept = None
            if kept is None:
                kept = self._kept = KeptZygote.start(warm, key, env, modules, cwd)
            return kept

    def prestart(self, warm: WarmStart, key: tuple[object, ...], env: dict[str, str], modules: Sequence[str],
                 cwd: str | None) -> None:
        """Start a provisional kept zygote, unless the kept one may serve this launch (its key but for the
        environment is this one's: the launch decides) or is busy; an idle one of another shape is replaced
        now, as the launch would replace it."""
        with self._lock:
            kept = self._own()
            if kept is not None and kept.alive() and (kept.in_flight or _same_but_env(kept.key, key)):
                return
            self._kept = None
            if kept is not None:
                kept.end()
            self._kept = KeptZygote.start(warm, key, env, modules, cwd)
            self._kept.provisional = True

    def _own(self) -> KeptZygote | None:
        """The kept zygote, under the lock; none in a forked copy of the caller (its parent's is not its own)."""
        if os.getpid() != self._owner:
            self._kept, self._owner = None, os.getpid()
        return self._kept

    def drop(self, kept: KeptZygote) -> None:
        with self._lock:
            if self._kept is kept:
                self._kept = None
        kept.end()

    def current(self) -> KeptZygote | None:
        """The kept zygote, if any (for tests and diagnostics)."""
        with self._lock:
            return self._kept if self._kept is not None and self._kept.alive() else None

    def shutdown(self) -> None:
        """At the caller's exit: end the kept zygote (pdeathsig would, but only when the process is gone)."""
        if os.getpid() != self._owner:
            return
        with self._lock:
            kept, self._kept = self._kept, None
        if kept is not None:
            kept.end()


KEPT = _KeptZygotes()

#: What no kept zygote's environment holds: each launch's own (its tag, heartbeat and stacks files).
_KEPT_LEFT_OUT = frozenset({AIR_PROCESS_TAG, AIR_HEARTBEAT_FILE, AIR_STACKS_FILE})
#: The position of the environment in a kept zygote's key (see _kept_key).
_KEY_ENV = 6


def _kept_key(warm: WarmStart, names: Sequence[str], cwd: str | None, env: Mapping[str, str]) -> tuple[object, ...]:
    """What a kept zygote must share with a launch to run it: the same Python, preload, sys.path, modules,
    world size, cwd, environment and idle time."""
    return (warm.python, warm.preload, warm.sys_path, tuple(names), warm.world_size, cwd,
            tuple(sorted(env.items())), warm_idle_s())


def _adoptable(kept: KeptZygote, key: tuple[object, ...], env: Mapping[str, str]) -> bool:
    """A provisional zygote (started with the caller's whole environment) can run a first launch of the
    same key but for the environment when the launch's shared environment is part of its own: the
    launch's plans unset the rest (what each launch sets itself: ports, ranks, its devices)."""
    return _same_but_env(kept.key, key) and all(kept.env.get(k) == v for k, v in env.items())


def _same_but_env(one: tuple[object, ...], other: tuple[object, ...]) -> bool:
    return one[:_KEY_ENV] + one[_KEY_ENV + 1:] == other[:_KEY_ENV] + other[_KEY_ENV + 1:]


def prestart_kept(preload: Sequence[str], module: str, world_size: int, env: Mapping[str, str],
                  cwd: str | None, *, grace_s: float) -> None:
    """Start this caller's kept zygote before its first launch is ready, so its imports (seconds, for
    torch) overlap what comes before the launch (the run's record, its slot claim, tracking) instead of
    following it. `env`: the environment every process of the launch starts from (the caller's, as the
    backend gives it). The launch adopts it (see _adoptable); one that cannot is started anew, as today."""
    if warm_idle_s() <= 0 or not python_can_fork() or 2 * world_size + 1 > _MAX_FDS:
        return
    base = {k: v for k, v in env.items() if k not in _KEPT_LEFT_OUT}
    warm = WarmStart.for_launch(preload, [base] * world_size, grace_s=grace_s, keep=True)
    KEPT.prestart(warm, _kept_key(warm, [module], cwd, base), base, [module], cwd)


def start_kept(warm: WarmStart, argvs: Sequence[Sequence[str]], envs: Sequence[dict[str, str]],
               cwds: Sequence[str | None], tag: str) -> Zygote | None:
    """Run a launch on this caller's kept zygote (started, or replaced, as needed). None when this launch
    cannot be kept (then it gets a one-shot zygote)."""
    from air.launcher.zygote import TAG_SLOT_ENV, TAG_SLOT_LEN

    if not warm.keep or warm_idle_s() <= 0 or 2 * len(argvs) + 1 > _MAX_FDS:
        return None
    if len(f"{AIR_PROCESS_TAG}={tag}") > len(TAG_SLOT_ENV) + 1 + TAG_SLOT_LEN:
        return None
    modules = [warm.module_of(argv) for argv in argvs]
    left_out = {*warm.call_env, *_KEPT_LEFT_OUT}
    base = {k: v for k, v in common_env(envs).items() if k not in left_out}
    names = sorted({module for module, _ in modules})
    key = _kept_key(warm, names, cwds[0], base)
    out_pipes = [os.pipe() for _ in argvs]
    err_pipes = [os.pipe() for _ in argvs]
    status_r, status_w = os.pipe()
    sent = [status_w, *[w for _, w in out_pipes], *[w for _, w in err_pipes]]
    n = len(argvs)

    def plan_over(shared: dict[str, str]) -> bytes:
        procs = proc_plans(modules, envs, cwds, shared, range(1, n + 1), range(n + 1, 2 * n + 1))
        return json.dumps({"procs": procs, "status": 0, "tag": tag, "grace_s": warm.grace_s,
                           "store": store_plan(warm)}).encode()

    data = plan_over(base)
    kept: KeptZygote | None = None
    try:
        if len(data) <= _MAX_PLAN:
            for _ in range(2):  # a second try if the kept one had just left (idle) when handed the plan
                candidate = KEPT.get(warm, key, base, names, cwds[0])
                if candidate is None:
                    break
                if candidate.env != base:  # an adopted provisional one: over its own, larger environment
                    data = plan_over(candidate.env)
                if candidate.submit(data, sent):
                    kept = candidate
                    break
                KEPT.drop(candidate)
    except BaseException:
        for fd in (status_r, *[r for r, _ in out_pipes], *[r for r, _ in err_pipes]):
            os.close(fd)
        raise
    finally:
        for fd in sent:
            os.close(fd)
    if kept is None:
        for fd in (status_r, *[r for r, _ in out_pipes], *[r for r, _ in err_pipes]):
            os.close(fd)
        return None
    pipes = read_ends(out_pipes, err_pipes) + kept.own_pipes()
    return Zygote(LeaderHandle(kept), [ForkedProcess(i) for i in range(n)], pipes,
                  os.fdopen(status_r, "rb", buffering=0))
