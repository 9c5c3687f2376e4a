"""Warm calls: a caller's zygote kept between its launches (`WarmStart.keep`), see warm.py.

A notebook calling `.distributed()` again and again gets the same zygote for every launch with the same
python, preload, sys.path, cwd, world size and environment, so later launches skip the import
altogether. The kept zygote forks one leader per launch (serve() in zygote.py), which does what a
one-shot zygote does for it; it ends with the caller (pdeathsig, atexit, the control socket's end),
after AIR_WARM_IDLE_S without a launch, or when a launch needs another one.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from typing import IO

from air.launcher.warm import (
    ForkedProcess,
    LeaderHandle,
    WarmStart,
    Zygote,
    common_env,
    read_ends,
    store_plan,
    warm_idle_s,
)
from air.settings import AIR_HEARTBEAT_FILE, AIR_PROCESS_TAG, AIR_STACKS_FILE

_MAX_FDS = 250  # SCM_RIGHTS takes at most 253 descriptors per message
_MAX_PLAN = 128 * 1024  # within a SOCK_SEQPACKET message's default limit

class KeptZygote:
    """A zygote kept between the launches of this caller (see serve() in zygote.py) and how to reach it."""

    def __init__(self, key: tuple[object, ...], popen: subprocess.Popen[bytes], sock: socket.socket,
                 grace_s: float) -> None:
        self.key = key
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
                    [warm.python, "-m", "air.launcher.zygote", "keep", str(theirs.fileno())],
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
        kept = cls(key, popen, ours, warm.grace_s)
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
            if os.getpid() != self._owner:  # a forked copy of the caller: its parent's zygote is not its own
                self._kept, self._owner = None, os.getpid()
            kept = self._kept
            if kept is not None and kept.key != key and kept.alive() and kept.in_flight:
                return None  # another call of this caller runs on it right now: this one goes one-shot
            if kept is not None and (kept.key != key or not kept.alive()):
                self._kept = None
                kept.end()
                kept = None
            if kept is None:
                kept = self._kept = KeptZygote.start(warm, key, env, modules, cwd)
            return kept

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
    left_out = {*warm.call_env, AIR_PROCESS_TAG, AIR_HEARTBEAT_FILE, AIR_STACKS_FILE}
    base = {k: v for k, v in common_env(envs).items() if k not in left_out}
    names = sorted({module for module, _ in modules})
    key = (warm.python, warm.preload, warm.sys_path, tuple(names), warm.world_size, cwds[0],
           tuple(sorted(base.items())), warm_idle_s())
    out_pipes = [os.pipe() for _ in argvs]
    err_pipes = [os.pipe() for _ in argvs]
    status_r, status_w = os.pipe()
    sent = [status_w, *[w for _, w in out_pipes], *[w for _, w in err_pipes]]
    n = len(argvs)
    procs = [{"module": module, "args": args, "cwd": cwd,
              "env": {k: v for k, v in env.items() if base.get(k) != v},
              "unset": [k for k in base if k not in env], "out": 1 + index, "err": 1 + n + index}
             for index, ((module, args), env, cwd) in enumerate(zip(modules, envs, cwds, strict=True))]
    plan = {"procs": procs, "status": 0, "tag": tag, "grace_s": warm.grace_s, "store": store_plan(warm)}
    data = json.dumps(plan).encode()
    kept: KeptZygote | None = None
    try:
        if len(data) <= _MAX_PLAN:
            for _ in range(2):  # a second try if the kept one had just left (idle) when handed the plan
                candidate = KEPT.get(warm, key, base, names, cwds[0])
                if candidate is None:
                    break
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
