"""Stopping the suite leaves no process (issue 35): SIGTERM (or SIGINT sent to pytest alone) becomes a
KeyboardInterrupt, so pytest stops the test under way and runs every fixture's teardown (servers, Ray
clusters, ...) as after Ctrl-C; a pytest-xdist controller first hands the signal on to its workers and waits
for their teardown. Then, once the session is over, every process still tagged as this session's is ended:
those whose environment carries this session's `SESSION_MARK` (inherited by all a test starts: `air`
commands, their detached supervisors and admission loops, servers, Ray nodes), or an AIR_HOME under the
session's temporary folder, and all their descendants (a walled run's processes, whose environment is made
afresh). A second signal, 5 s or more after the first, stops waiting for teardowns: the sweep runs at once.

tests/conftest.py installs it; a pytest run outside the suite loads it with `-p session_stop` (tests/ on
PYTHONPATH), as tests/test_session_stop.py does.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import threading
import time
import uuid
from pathlib import Path
from types import FrameType

import psutil
import pytest

#: The environment variable that tags every process of one test session (the value is the session's).
SESSION_MARK = "TESTS_SESSION_MARK"
#: How long the controller waits for its xdist workers' teardowns after handing them the signal.
WORKER_TEARDOWN_S = 300.0
#: A repeated signal within this many seconds of the first is the same stop (a group's signal, then a
#: forwarded one), not a request to hurry.
REPEAT_S = 5.0
#: The command line execnet starts an xdist worker with.
_XDIST_WORKER_CMD = "exec(eval(sys.stdin.readline()))"

_state: dict[str, object] = {"signal": None, "at": 0.0, "basetemp": None}


def install(config: pytest.Config) -> None:
    """Tag this session's processes and turn SIGTERM/SIGINT into a stop that tears fixtures down."""
    if threading.current_thread() is not threading.main_thread() or _state.get("installed"):
        return
    _state["installed"] = True
    if not hasattr(config, "workerinput"):  # a controller or a plain run: a session of its own
        os.environ[SESSION_MARK] = uuid.uuid4().hex
    else:
        os.environ.setdefault(SESSION_MARK, uuid.uuid4().hex)  # a worker: its controller's session
    _state["pid"] = os.getpid()
    signal.signal(signal.SIGTERM, _on_signal)
    # Also where it started ignoring SIGINT (a shell's background job, as `make test` runs it): a handled
    # signal is back to its default in the programs a test starts, so their Ctrl-C works as in a terminal.
    signal.signal(signal.SIGINT, _on_signal)
    os.register_at_fork(after_in_child=_as_before)


def _as_before() -> None:
    """A process forked from pytest (a launcher's rank, a zygote) gets Python's own handling back: SIGTERM
    ends it as it did before this plugin, SIGINT raises KeyboardInterrupt there."""
    if signal.getsignal(signal.SIGTERM) is _on_signal:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if signal.getsignal(signal.SIGINT) is _on_signal:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _on_signal(signum: int, frame: FrameType | None) -> None:
    if os.getpid() != _state.get("pid"):  # forked without the fork hook (os.fork through C): as before
        _as_before()
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        os.kill(os.getpid(), signum)
        return
    first = _state["signal"] is None
    if not first:
        if time.monotonic() - float(_state["at"]) < REPEAT_S:  # type: ignore[arg-type]
            return
        sweep()
        os._exit(128 + signum)
    _state["signal"], _state["at"] = signum, time.monotonic()
    workers = [p for p in _children() if _XDIST_WORKER_CMD in " ".join(_cmdline(p))]
    for worker in workers:
        with contextlib.suppress(psutil.Error):
            worker.send_signal(signum)
    # A worker that tore down waits for this controller to close it: wait for its word, not its exit.
    deadline = time.monotonic() + WORKER_TEARDOWN_S
    while workers and time.monotonic() < deadline:
        workers = [w for w in workers if w.is_running() and not _done_flag(w.pid).exists()]
        time.sleep(0.1)
    raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")


def _done_flag(pid: int) -> Path:
    """The file an xdist worker of this session writes once its teardown after a stop is over."""
    return Path(tempfile.gettempdir(), f"tests-session-{os.environ.get(SESSION_MARK, '')}-{pid}.stopped")


def stopped() -> bool:
    """Whether a signal stopped this session."""
    return _state["signal"] is not None


def finish(config: pytest.Config) -> None:
    """At the session's end: after a stop, end every process still tagged as this session's."""
    if stopped():
        factory = getattr(config, "_tmp_path_factory", None)
        basetemp = getattr(factory, "_basetemp", None) if factory is not None else None
        _state["basetemp"] = str(basetemp) if basetemp is not None else None
        if hasattr(config, "workerinput"):  # its controller ends what is left, once every worker is over
            with contextlib.suppress(OSError):
                _done_flag(os.getpid()).write_text("torn down\n")
            return
        sweep()
        for flag in Path(tempfile.gettempdir()).glob(f"tests-session-{os.environ.get(SESSION_MARK, '')}-*.stopped"):
            flag.unlink(missing_ok=True)


def _children() -> list[psutil.Process]:
    try:
        return psutil.Process().children()
    except psutil.Error:
        return []


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


def session_processes(mark: str | None = None, air_home_under: str | None = None, *,
                      own_children: bool = True) -> list[psutil.Process]:
    """Processes tagged with `mark` (default: this session's) or with an AIR_HOME under `air_home_under`,
    and their descendants (`own_children`: this process's too); never this process or its ancestors."""
    mark = mark if mark is not None else os.environ.get(SESSION_MARK)
    spared = {os.getpid()} | {p.pid for p in _ancestors()}
    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter():
        if proc.pid in spared:
            continue
        try:
            env = proc.environ()
        except psutil.Error:
            continue
        home = env.get("AIR_HOME", "")
        if (mark and env.get(SESSION_MARK) == mark) or (
                air_home_under and (home == air_home_under or home.startswith(air_home_under.rstrip("/") + "/"))):
            found[proc.pid] = proc
    if own_children:
        with contextlib.suppress(psutil.Error):
            found.update({p.pid: p for p in psutil.Process().children(recursive=True)})
    for proc in list(found.values()):
        with contextlib.suppress(psutil.Error):
            found.update({p.pid: p for p in proc.children(recursive=True)})
    alive = []
    for pid, proc in found.items():
        if pid in spared:
            continue
        with contextlib.suppress(psutil.Error):
            if proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
    return alive


def _ancestors() -> list[psutil.Process]:
    try:
        return psutil.Process().parents()
    except psutil.Error:
        return []


def sweep(rounds: int = 3) -> None:
    """End this session's processes: SIGTERM, 5 s, then SIGKILL; again while new ones appear."""
    basetemp = _state["basetemp"]
    for _ in range(rounds):
        procs = session_processes(air_home_under=str(basetemp) if basetemp else None)
        if not procs:
            return
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                proc.terminate()
        _, left = psutil.wait_procs(procs, timeout=5)
        for proc in left:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(left, timeout=5)


# ---- as a plugin of its own (`-p session_stop`) ------------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    install(config)


def pytest_unconfigure(config: pytest.Config) -> None:
    finish(config)


__all__ = ["SESSION_MARK", "finish", "install", "session_processes", "stopped", "sweep"]
