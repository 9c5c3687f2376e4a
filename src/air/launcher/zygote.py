"""The warm-start process: import the heavy modules once, then fork every process of a launch from it.

`python -m air.launcher.zygote PLAN_FD STATUS_FD`, started by `Launch` (see warm.py) with the launch's
common environment. It reads its plan (JSON) from PLAN_FD, imports `preload` (torch, ...) once with the
cyclic GC off (see import_with_gc_off), forks one child per process (each in its own session, its
stdout/stderr on the pipes the launcher reads, its own environment and cwd, the GC back on), optionally
hosts the c10d TCPStore the ranks rendezvous on (as torchrun's agent does, so no rank waits for another
to open it), and reports on STATUS_FD:

    start <index> <pid>
    exit <index> <returncode> <unix time>     (returncode < 0: killed by that signal, as in Popen)
    note <text>
    leader <pid>                              (kept zygote: the process running this launch)
    done <returncode>                         (kept zygote: that process's exit code, just before it leaves)

`python -m air.launcher.zygote keep CONTROL_FD` is a zygote kept between the launches of one caller
(warm calls, see serve()): it preloads once and forks one leader per launch, which does all of the above
for that launch, so that nothing of one launch stays behind in the zygote for the next.

A child is what `python -m MODULE ARGS` would be, but starts in milliseconds with `preload` already
imported; on its way out it runs its atexit handlers, flushes, and `os._exit`s (skipping the interpreter
teardown that costs torch processes most of a second and sometimes aborts in gloo's destructors).

Kept to the standard library: this process is on the critical path of every call.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import io
import json
import os
import runpy
import select
import signal
import socket
import sys
import time
import traceback
from types import FrameType
from typing import TypedDict

from air.settings import AIR_LAUNCHER_PID, AIR_PROCESS_TAG, AIR_WARM_TAG_SLOT

_PR_SET_PDEATHSIG = 1
#: In a kept zygote's environment: room, in the process's own environment block, for one launch's
#: AIR_PROCESS_TAG, written there by the launch's leader (see _write_tag).
TAG_SLOT_ENV = AIR_WARM_TAG_SLOT
TAG_SLOT_LEN = 96
_children: dict[int, int] = {}  # pid -> index
_leaders: set[int] = set()  # a kept zygote's per-launch leaders
_stopping = False
_forking_done = False


class _ProcPlanRequired(TypedDict):
    module: str
    args: list[str]
    out: int
    err: int
    env: dict[str, str]


class _ProcPlan(_ProcPlanRequired, total=False):
    """One process to fork, as warm.proc_plans writes it (JSON): `python -m module args` on fds out/err."""

    cwd: str | None
    unset: list[str]


class _StorePlanRequired(TypedDict):
    host: str
    port: int
    world_size: int


class _StorePlan(_StorePlanRequired, total=False):
    """The rendezvous store to host (warm.store_plan)."""

    timeout_s: float


class _Plan(TypedDict, total=False):
    """A launch's plan (warm.start_zygote, a kept zygote's launch) or a kept zygote's setup (the
    preload only): JSON from the launcher."""

    procs: list[_ProcPlan]
    status: int
    tag: str | None
    grace_s: float
    idle_s: float
    store: _StorePlan | None
    preload: list[str]
    sys_path: list[str]
    modules: list[str]



def _status(fd: int, text: str) -> None:
    try:
        os.write(fd, (text + "\n").encode())
    except OSError:
        pass  # the launcher is gone; the children still get reaped


def _pdeathsig(sig: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _on_sigterm(_signum: int, _frame: FrameType | None) -> None:
    """Before any fork (a kept zygote: idle, or still preloading): just go. After: pass it on to every
    child (a kept zygote's: each running launch's leader, which ends its own launch), keep reaping, leave."""
    global _stopping
    _stopping = True
    _reap_leaders()  # a kept zygote's leaders that already ended (it reaps them only every 0.2 s)
    running = [*_children, *_leaders]
    if not _forking_done and not running:
        os._exit(128 + signal.SIGTERM)
    for pid in running:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def _reopen_stdio() -> None:
    """Fresh sys.std* over fds 0-2 (now the child's own), unbuffered like PYTHONUNBUFFERED=1."""
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # lives as long as the process
    for fd, name in ((1, "stdout"), (2, "stderr")):
        stream = io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                                  line_buffering=True, write_through=True)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _reseed() -> None:
    """A fresh process seeds numpy's global generator from the OS; a forked one would share the parent's."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        try:
            numpy.random.seed()
        except Exception:  # a numpy without the legacy global generator
            pass


def _apply_thread_count() -> None:
    """A fresh process's torch reads OMP_NUM_THREADS when it starts; a forked one keeps the zygote's
    count (the zygote imported torch before the rank's environment existed): apply the child's own."""
    torch = sys.modules.get("torch")
    wanted = os.environ.get("OMP_NUM_THREADS", "")
    if torch is None or not wanted.isdigit() or int(wanted) < 1:
        return
    try:
        torch.set_num_threads(int(wanted))
    except Exception:  # a torch without it: the rank runs with the zygote's count
        pass


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    sys.stderr.write(f"{exc.code}\n")
    return 1


def _run_child(proc: _ProcPlan, zygote_pid: int, close_fds: list[int], go_fd: int | None) -> None:
    """In the forked child: become `python -m MODULE ARGS` in the child's own session. Never returns."""
    code = 1
    try:
        gc.enable()  # off in the zygote only for its imports (see import_with_gc_off)
        os.setsid()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _pdeathsig(signal.SIGTERM)
        if os.getppid() != zygote_pid:  # the zygote died before prctl took effect
            os._exit(128 + signal.SIGTERM)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(proc["out"], 1)
        os.dup2(proc["err"], 2)
        for fd in {devnull, *close_fds} - {0, 1, 2, go_fd}:
            try:
                os.close(fd)
            except OSError:
                pass
        _reopen_stdio()
        for key in proc.get("unset", []):
            os.environ.pop(key, None)
        os.environ.update(proc["env"])
        os.environ[AIR_LAUNCHER_PID] = str(zygote_pid)  # the parent this child must not outlive
        cwd = proc.get("cwd")
        if cwd:
            os.chdir(cwd)
        _reseed()
        _apply_thread_count()
        if go_fd is not None:  # wait (microseconds) until the zygote says whether its store is up
            answer = os.read(go_fd, 1)
            os.close(go_fd)
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True" if answer == b"A" else "False"
        sys.argv = [proc["module"], *proc["args"]]
        sys.modules.pop(proc["module"], None)  # preloaded for its imports; runs afresh as __main__
        try:
            runpy.run_module(proc["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = _exit_code(exc)
        except BaseException:  # printed as python -m would
            traceback.print_exc()
            code = 1
    finally:
        exit_now(code)


def exit_now(code: int) -> None:
    """Leave as a normal exit would (non-daemon threads joined, atexit handlers run, stdio flushed), but
    skip the interpreter's teardown: with torch loaded it takes most of a second, and gloo's destructors
    sometimes abort in it ("terminate called without an active exception") after the work succeeded."""
    try:
        import threading

        threading._shutdown()  # type: ignore[attr-defined]
    except Exception:
        pass
    try:
        import atexit

        atexit._run_exitfuncs()
    except Exception:
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


def _host_store(store: _StorePlan) -> object | None:
    """The c10d TCPStore every rank connects to (torchrun's agent store); None if it cannot be opened."""
    try:
        from datetime import timedelta

        from torch.distributed import TCPStore

        return TCPStore(host_name=store["host"], port=int(store["port"]), world_size=int(store["world_size"]),
                        is_master=True, timeout=timedelta(seconds=float(store.get("timeout_s", 1800))),
                        wait_for_workers=False)
    except Exception as exc:  # the ranks then open it themselves (rank 0), as without air
        sys.stderr.write(f"air: warm start: rendezvous store not opened here ({exc}); rank 0 opens it\n")
        return None


def _sweep(grace_s: float) -> None:
    """Stopped by SIGTERM: end whatever the children left behind (everything carrying the launch's tag).

    Done on every SIGTERM, not only when the launcher is gone. Its own teardown sweeps the same tag, so
    this is harmless when it is alive; and its death cannot be told apart reliably: the pdeathsig comes
    when the launcher's thread that started this process exits, which can be while the rest of a
    SIGKILLed launcher is still being torn down and getppid() still names it.
    """
    tag = os.environ.get(AIR_PROCESS_TAG)
    if not tag:
        return
    try:
        from air.launcher.procs import reap_tag

        reap_tag(tag, grace_s=grace_s)
    except Exception:  # best effort on the way out
        pass


def import_with_gc_off(modules: list[str]) -> list[tuple[str, BaseException]]:
    """Import `modules` with the cyclic GC off, then freeze what they made; return what failed to import.
    The GC stays off: the caller turns it back on (a forked child does it before running its code).

    Why: importing torch allocates ~0.5 M long-lived objects, and the collections they trigger cost
    about 15 % of the import (0.5 s of ~3.5 s on the 2-core VM), while the few cycles an import leaves as
    garbage are not worth a full collection (0.3 s). Frozen objects are never walked again by later
    collections, nor copy-on-write touched by them after a fork: the recipe of Python's gc docs for
    fork without exec, and cheaper collections during training either way.
    """
    gc.disable()
    failed: list[tuple[str, BaseException]] = []
    for name in modules:
        try:
            importlib.import_module(name)
        except (Exception, SystemExit) as exc:  # the code that needs it imports it again and fails there
            failed.append((name, exc))
    gc.freeze()
    return failed


def _launch(plan: _Plan, status_fd: int, close_in_children: list[int]) -> int:
    """Fork every process of the plan, host its rendezvous store, report, reap; sweep if stopped."""
    global _forking_done
    store_plan = plan.get("store")
    go_pipes: list[tuple[int, int]] = []
    all_fds = [fd for p in plan["procs"] for fd in (p["out"], p["err"])] + [status_fd, *close_in_children]
    zygote_pid = os.getpid()
    for index, proc in enumerate(plan["procs"]):
        if _stopping:
            break
        go_r = go_w = None
        if store_plan:
            go_r, go_w = os.pipe()
            go_pipes.append((go_r, go_w))
        pid = os.fork()
        if pid == 0:
            _run_child(proc, zygote_pid, all_fds + [fd for pair in go_pipes for fd in pair], go_r)
        _children[pid] = index
        for fd in (proc["out"], proc["err"]) + ((go_r,) if go_r is not None else ()):
            os.close(fd)
        _status(status_fd, f"start {index} {pid}")
    _forking_done = True
    store = _host_store(store_plan) if store_plan and not _stopping else None
    for _, go_w in go_pipes:
        try:
            os.write(go_w, b"A" if store is not None else b"R")
        except OSError:
            pass
        os.close(go_w)
    while _children:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        ended = _children.pop(pid, None)
        if ended is not None:
            _status(status_fd, f"exit {ended} {os.waitstatus_to_exitcode(status)} {time.time():.6f}")
    if _stopping:
        _sweep(float(plan.get("grace_s", 1.0)))
    return 0


def _preload(plan: _Plan) -> list[str]:
    """sys.path as the caller's, then the preload (GC off, frozen); returns the notes to report."""
    for entry in reversed(plan.get("sys_path", [])):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    started = time.monotonic()
    notes = [f"preload of {name} failed: {type(exc).__name__}: {exc}"
             for name, exc in import_with_gc_off([*plan.get("preload", []), *plan.get("modules", [])])]
    notes.append(f"preloaded in {time.monotonic() - started:.3f}s")
    return notes


def main(plan_fd: int, status_fd: int) -> int:
    """One launch: preload, fork every process, end when they have."""
    launcher_pid = os.getppid()
    signal.signal(signal.SIGTERM, _on_sigterm)
    _pdeathsig(signal.SIGTERM)
    if os.getppid() != launcher_pid:
        return 128 + signal.SIGTERM
    with os.fdopen(plan_fd, "rb") as fh:
        plan = json.loads(fh.read())
    plan["modules"] = sorted({p["module"] for p in plan["procs"]})
    for note in _preload(plan):
        _status(status_fd, f"note {note}")
    return _launch(plan, status_fd, [])


# -- kept between launches (warm calls) -----------------------------------------------------------------

def _write_tag(tag: str) -> bool:
    """Write AIR_PROCESS_TAG=tag over the tag slot of this process's original environment block.

    Why: tag sweeps read /proc/PID/environ, which shows that block, not os.environ; a forked process
    inherits its parent's block as it is. A kept zygote cannot carry any one launch's tag, so each
    launch's leader writes its own into the slot the zygote was started with, and every process it
    forks (ranks, their forked workers) shows it, as a one-shot zygote's children show the tag it was
    started with (setproctitle rewrites the same memory)."""

    try:
        with open("/proc/self/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        env_start, env_end = int(fields[47]), int(fields[48])  # fields 50 and 51 of proc(5)
        with open("/proc/self/environ", "rb") as fh:
            block = fh.read()
        needle = f"{TAG_SLOT_ENV}=".encode()
        if block.startswith(needle):
            offset = 0
        else:
            found = block.find(b"\0" + needle)
            if found < 0:
                return False
            offset = found + 1
        size = block.index(b"\0", offset) - offset
        entry = f"{AIR_PROCESS_TAG}={tag}".encode()
        if len(entry) > size or env_start + offset + size > env_end:
            return False
        ctypes.memmove(env_start + offset, entry.ljust(size, b"\0"), size)
        with open("/proc/self/environ", "rb") as fh:
            return entry in fh.read().split(b"\0")
    except (OSError, ValueError, IndexError):
        return False


def _lead(plan: _Plan, fds: list[int], zygote_pid: int, control_fd: int, notes: list[str]) -> None:
    """A kept zygote's child that runs one launch as a one-shot zygote would (fork, store, reap, sweep).

    The zygote itself never runs anything of a launch, so no launch leaves anything in it for the next.
    Its own session (the launcher ends it by group); dies with the zygote. Never returns."""

    code = 1
    try:
        os.setsid()
        _leaders.clear()  # the other launches' leaders are the kept zygote's to end, not this one's
        signal.signal(signal.SIGTERM, _on_sigterm)
        _pdeathsig(signal.SIGTERM)
        if os.getppid() != zygote_pid:
            os._exit(128 + signal.SIGTERM)
        os.close(control_fd)
        for proc in plan["procs"]:
            proc["out"], proc["err"] = fds[proc["out"]], fds[proc["err"]]
        status_fd = fds[plan["status"]]
        tag = plan.get("tag")
        os.environ.pop(TAG_SLOT_ENV, None)
        if tag:
            os.environ[AIR_PROCESS_TAG] = tag
            if not _write_tag(tag):
                _status(status_fd, "note the launch's tag is not in its processes' /proc environ")
        os.dup2(plan["procs"][0]["out"], 1)  # what a one-shot zygote writes lands in the first log too
        os.dup2(plan["procs"][0]["err"], 2)
        _reopen_stdio()
        _status(status_fd, f"leader {os.getpid()}")
        for note in notes:
            _status(status_fd, f"note {note}")
        code = _launch(plan, status_fd, [])
        _status(status_fd, f"done {code}")
    except BaseException:  # reported in the first process's log
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)  # as a one-shot zygote leaves: the store and preloaded modules need no teardown


def _reap_leaders(block_s: float = 0.0) -> None:
    deadline = time.monotonic() + block_s
    while _leaders:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            _leaders.clear()
            return
        if pid:
            _leaders.discard(pid)
        elif time.monotonic() >= deadline:
            return
        else:
            time.sleep(0.02)


def serve(control_fd: int) -> int:
    """A zygote kept between launches of one caller: preload once, then fork one leader per launch.

    Messages on CONTROL_FD (a SOCK_SEQPACKET socket): first the setup (JSON: preload, sys_path, modules,
    idle_s, grace_s); then one launch plan each, with its pipes as SCM_RIGHTS fds. It answers `ready`
    once preloaded and `k` for each plan it took. It leaves when told (SIGTERM, or its caller's death
    through pdeathsig), when the caller closes the socket, or after `idle_s` without a launch.
    """
    launcher_pid = os.getppid()
    signal.signal(signal.SIGTERM, _on_sigterm)
    _pdeathsig(signal.SIGTERM)
    if os.getppid() != launcher_pid:
        return 128 + signal.SIGTERM
    sock = socket.socket(fileno=control_fd)
    setup = json.loads(sock.recv(1 << 20) or b"null")
    if not setup:
        return 0
    notes = _preload(setup)
    devnull = os.open(os.devnull, os.O_RDWR)  # the first launch's pipes: its pump waits for their end
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.close(devnull)
    _reopen_stdio()
    idle_s, grace_s = float(setup.get("idle_s", 600.0)), float(setup.get("grace_s", 1.0))
    zygote_pid = os.getpid()
    try:
        sock.send(b"ready")
        idle_since = time.monotonic()
        while not _stopping:
            _reap_leaders()
            if _leaders:
                idle_since = time.monotonic()
            wait = idle_s - (time.monotonic() - idle_since)
            if wait <= 0:
                break
            ready, _, _ = select.select([sock], [], [], min(wait, 0.2) if _leaders else wait)
            if not ready or _stopping:
                continue
            data, fds, _, _ = socket.recv_fds(sock, 1 << 20, 256)
            if not data:
                break  # the caller closed its end: gone
            sock.send(b"k")
            pid = os.fork()
            if pid == 0:
                _lead(json.loads(data), fds, zygote_pid, control_fd, notes)
            _leaders.add(pid)
            for fd in fds:
                os.close(fd)
    except OSError:
        pass  # the caller's end is gone
    _on_sigterm(signal.SIGTERM, None)  # a leader still running sweeps its launch on the way out
    _reap_leaders(block_s=3 * grace_s + 2)
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "keep":
        code = serve(int(sys.argv[2]))
    else:
        code = main(int(sys.argv[1]), int(sys.argv[2]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the store and preloaded modules need no teardown
