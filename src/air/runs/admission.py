"""One admission loop: queued runs are rows, not processes.

`air run` records its run QUEUED (a place in its pool's queue) and wakes the loop; the loop walks the queue
in the slot ledger's order and, for each run the ledger lets in (`try_claim_slots` for this machine's slots,
`try_admit` for a Ray run), starts that run's supervisor, which then finds its slots already held. A run
waits as a row: no process, no memory, until its turn.

There is one loop per AIR_HOME, holding `AirHome.admission_lock` (flock): `air server` runs it as a thread
(`start_in_thread`), woken at once by a submit in the server (`wake`); without a server, `air run` makes one
pass itself and, if runs still wait, starts a detached `python -m air.runs.admission`, which exits once
nothing is queued. If that loop is killed, any later local `air` command that finds a run `air run` queued
for it (`runs.local_admission`) and the lock free starts a new one (`ensure_loop`). Either loop notices a run ending
(its slots freed) by one cheap read of SQLite's `PRAGMA data_version` every `ADMISSION_POLL_S`, and passes
over the queue every `ADMISSION_TICK_S` anyway.

The order and the limits are the ledger's alone (ledger.py): the loop only decides whom to ask. Within one
queue (slot kind, backend, pool) it asks the first run; a run refused while no run waits ahead of it
(`queued_ahead` empty: not enough free slots) gets its supervisor at once as the queue's one *standby*,
which claims in the ledger itself (the backend's `acquire` polls it) the moment slots free, so a freed slot
is taken within that poll, not after a supervisor's start-up; nothing behind it may pass it. A run refused
behind another points the loop at that one. So each queue has at most one waiting process, whatever its
depth. Runs that wait in their own process (the standby, a local `@distributed` call, a retry of a running
supervisor) are not the loop's: they have a supervisor pid.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING

from air.accelerators import MachineAccelerators, parse_accelerator_type
from air.constants import ADMISSION_POLL_S, ADMISSION_TICK_S
from air.errors import AirError, GPUValidationError
from air.home import AirHome
from air.processes import PROCESS_KINDS
from air.runs.spawn import spawn_supervisor
from air.settings import AIR_PROCESS_TAG, AIR_SUPERVISOR
from air.store.paths import RunPaths
from air.store.run_store import RunStore
from air.store.states import RunStatus, StatusConflictError

if TYPE_CHECKING:
    from air.config import AirConfig

_log = logging.getLogger("air.admission")

#: The loop running in this process (`air server`'s thread), which `wake` pokes; None: none here.
_IN_PROCESS: AdmissionLoop | None = None


@dataclass(frozen=True)
class QueuedRow:
    """What the loop reads of one QUEUED run that has no supervisor yet."""

    id: str
    backend: str
    pool: str | None
    user: str
    accelerator_type: str
    num_accelerators: int

    @property
    def kind(self) -> str:
        return self.accelerator_type.split("_", 1)[0].upper()

    @property
    def queue(self) -> tuple[str, str, str | None]:
        """The queue it waits in: the ledger's FIFO is per slot kind, backend and pool."""
        return (self.kind, self.backend, self.pool)


#: The runs the loop admits: QUEUED workloads without a supervisor (a call's caller or call driver drives it
#: from its creation, a standby or a retry waits in its own supervisor: never the loop's).
_LOOPS_RUNS = "FROM runs WHERE status = ? AND supervisor_pid IS NULL AND kind = 'workload'"


def queued_rows(store: RunStore) -> list[QueuedRow]:
    """The loop's runs, in the order they entered the queue."""
    rows = store.reader().execute(
        f"SELECT id, backend, pool, user, accelerator_type, num_accelerators {_LOOPS_RUNS} ORDER BY queue_seq",
        (RunStatus.QUEUED.value,))
    return [QueuedRow(r[0], r[1], r[2], r[3], r[4], int(r[5])) for r in rows]


def has_queued(store: RunStore) -> bool:
    """Whether any run waits for the loop (QUEUED without a supervisor)."""
    return store.reader().execute(f"SELECT 1 {_LOOPS_RUNS} LIMIT 1", (RunStatus.QUEUED.value,)).fetchone() is not None


def _own_environ() -> dict[str, str]:
    """This process's environment without what ties it to a run of its own (a supervisor's, a node's tag):
    what the loop and the supervisors it starts get, independent of any outer run."""
    return {k: v for k, v in os.environ.items() if k not in (AIR_PROCESS_TAG, AIR_SUPERVISOR)}


def save_environ(run_id: str, store: RunStore | None = None) -> None:
    """Keep the environment `air run` was typed in for the run's supervisor (see RunPaths.submit_environ);
    with `store`, also mark the (PENDING) run as the local loop's, before it is queued: any command that
    finds it waiting without a live loop starts one (`ensure_loop`)."""
    from air.files import atomic_write_text

    atomic_write_text(RunPaths(run_id).submit_environ, json.dumps(_own_environ()), mode=0o600, durable=False)
    if store is not None:
        with store.writer() as conn:
            conn.execute("UPDATE runs SET local_admission = 1 WHERE id = ?", (run_id,))


def waiting_for_local_loop(store: RunStore) -> bool:
    """Whether a run `air run` queued for the local loop still waits for it (one probe of a partial index:
    rows written by hand or queued in a server are not counted)."""
    row = store.reader().execute(
        f"SELECT 1 {_LOOPS_RUNS} AND local_admission = 1 LIMIT 1", (RunStatus.QUEUED.value,)).fetchone()
    return row is not None


def ensure_loop(store: RunStore) -> int | None:
    """Start the local loop if runs `air run` queued wait and no loop holds this AIR_HOME's lock (it was
    killed, or its start failed); returns the new loop's pid, None if none was needed. What every local
    command does (air.cli.main): cheap when nothing waits (one index probe), one flock test otherwise.
    Never in `air server`, whose own thread is the loop."""
    if in_process() or not waiting_for_local_loop(store):
        return None
    home = AirHome()
    if loop_running(home):
        return None
    _log.info("runs wait in the queue and no admission loop runs (was it killed?): starting one")
    return start_local_loop(home)


def _saved_environ(run_id: str) -> dict[str, str] | None:
    try:
        data = json.loads(RunPaths(run_id).submit_environ.read_text())
    except (OSError, ValueError):
        return None  # a server's run: its supervisor gets the server's environment
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else None


class AdmissionLoop:
    """Admits queued runs in the ledger's order and starts their supervisors (see the module docstring).
    `spawn(run_id, environ)` starts a supervisor and returns its pid (injectable for tests)."""

    def __init__(self, store: RunStore, *, spawn: Callable[[str, dict[str, str] | None], int] | None = None,
                 poll_s: float = ADMISSION_POLL_S, tick_s: float = ADMISSION_TICK_S) -> None:
        self.store = store
        self.poll_s = poll_s
        self.tick_s = tick_s
        self.woken = threading.Event()
        self._spawn = spawn or spawn_supervisor
        self._machine: MachineAccelerators | None = None
        self._children: set[int] = set()

    # -- one pass -----------------------------------------------------------------------------------
    def admit_pass(self) -> list[str]:
        """Admit every run the ledger lets in now and start its supervisor; returns their ids."""
        rows = queued_rows(self.store)
        if not rows:
            return []
        from air.config import load_config

        config = load_config()
        limit = config.max_running_runs_per_user
        queues: dict[tuple[str, str, str | None], dict[str, QueuedRow]] = {}
        for queued in rows:
            queues.setdefault(queued.queue, {})[queued.id] = queued
        at_limit: dict[str, bool] = {}
        started: list[str] = []
        for untried in queues.values():
            row: QueuedRow | None = next(iter(untried.values()))
            while row is not None:
                del untried[row.id]
                if limit is not None and self._at_limit(row.user, limit, at_limit):
                    row = next(iter(untried.values()), None)  # a user at the limit holds up no one
                    continue
                admitted = self._claim(row, config, limit)
                if admitted is not False:
                    if admitted:
                        self._start(row)
                        started.append(row.id)
                        at_limit.pop(row.user, None)
                    row = next(iter(untried.values()), None)
                    continue
                ahead = self.store.queued_ahead(row.id, user_limit=limit, admitted_wait=row.backend != "local")
                if not ahead:  # refused as first in line: not enough free slots, and no one behind may pass it
                    self._start(row)  # its supervisor stands by, claiming the moment slots free (see above)
                    started.append(row.id)
                    break
                # Refused behind another run: ask that one (if it waits in its own process, nothing here may pass).
                row = untried.get(ahead[0])
        return started

    def _at_limit(self, user: str, limit: int, cache: dict[str, bool]) -> bool:
        if user not in cache:
            cache[user] = self.store.running_runs_of(user) >= limit
        return cache[user]

    def _claim(self, row: QueuedRow, config: AirConfig, limit: int | None) -> bool | None:
        """Ask the ledger: True admitted (slots held), False not yet, None not the loop's any more
        (canceled meanwhile) or never admissible here (its supervisor is started to say why)."""
        try:
            if row.backend != "local":
                return self.store.try_admit(row.id, user_limit=limit)
            accelerator = parse_accelerator_type(row.accelerator_type)
            capacity = self._capacity(accelerator.is_cpu)
            allowed = config.pool_slots(row.pool, row.kind, capacity)
            return self.store.try_claim_slots(row.id, row.kind, row.num_accelerators, capacity, slots=allowed,
                                              user_limit=limit) is not None
        except StatusConflictError:
            return None
        except (GPUValidationError, ValueError) as exc:  # it can never fit: its supervisor ends it with the reason
            _log.warning("run %s cannot be admitted (%s); its supervisor ends it", row.id, exc)
            return True

    def _capacity(self, cpu: bool) -> int:
        if self._machine is None:
            from air.accelerators import discover

            self._machine = discover()
        return self._machine.cpu_slots if cpu else len(self._machine.gpus)

    def _start(self, row: QueuedRow) -> None:
        try:
            pid = self._spawn(row.id, _saved_environ(row.id))
        except Exception as exc:  # its slots go back; the run ends with the reason, not stuck QUEUED
            _log.error("run %s: could not start its supervisor: %s", row.id, exc)
            from air.store.states import FailureClass

            with contextlib.suppress(AirError):
                self.store.transition(row.id, RunStatus.INTERNAL_ERROR, reason=f"Could not start the supervisor: "
                                      f"{exc}", failure_class=FailureClass.INFRASTRUCTURE,
                                      expected_from=RunStatus.QUEUED)
            return
        self._children.add(pid)
        # the supervisor has the environment now: the saved copy (it may hold the user's credentials) goes
        RunPaths(row.id).submit_environ.unlink(missing_ok=True)
        with contextlib.suppress(ValueError, AirError):  # (it may have ended already; it records itself too)
            self.store.set_supervisor(row.id, pid)
        _log.info("run %s admitted: supervisor pid %d", row.id, pid)

    def _collect(self) -> None:
        """Collect the exit status of supervisors this loop started that ended (no zombie lingers)."""
        for pid in list(self._children):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if done:
                self._children.discard(pid)

    # -- the loop -----------------------------------------------------------------------------------
    def run(self, *, stop: threading.Event | None = None, until_idle: bool = False) -> None:
        """Pass over the queue whenever woken, whenever the store changed, and every `tick_s`; return when
        `stop` is set or (`until_idle`) when nothing waits any more."""
        version = None
        next_tick = 0.0
        while stop is None or not stop.is_set():
            now = time.monotonic()
            current = self._data_version()
            if self.woken.is_set() or current != version or now >= next_tick:
                self.woken.clear()
                version = current
                next_tick = now + self.tick_s
                try:
                    self.admit_pass()
                except Exception as exc:  # a failed pass is tried again at the next change or tick
                    _log.warning("admission pass failed: %s", exc, exc_info=True)
                self._collect()
                if until_idle and (not has_queued(self.store) or not self.store.path.exists()):
                    return  # (a deleted AIR_HOME: nothing can be admitted any more)
            self.woken.wait(self.poll_s)

    def _data_version(self) -> int:
        """Changes whenever another connection committed to the store (a run ended, one was queued)."""
        return int(self.store.reader().execute("PRAGMA data_version").fetchone()[0])


# -- one loop per AIR_HOME ------------------------------------------------------------------------------
@contextlib.contextmanager
def _lock_file(home: AirHome) -> Iterator[IO[str]]:
    home.root.mkdir(parents=True, exist_ok=True)
    handle = open(home.admission_lock, "a+")
    try:
        yield handle
    finally:
        handle.close()


def _try_lock(handle: IO[str]) -> bool:
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def loop_running(home: AirHome | None = None) -> bool:
    """Whether this AIR_HOME's admission loop holds its lock now."""
    with _lock_file(home or AirHome()) as handle:
        if _try_lock(handle):
            fcntl.flock(handle, fcntl.LOCK_UN)
            return False
        return True


def wake(store: RunStore | None = None) -> None:
    """A run was queued: the loop of this process (`air server`) passes at once. Without one, a running
    local loop of this AIR_HOME sees the new row within ADMISSION_POLL_S; if none runs, this process makes
    the pass itself (a run admitted at once needs no loop) and starts the local loop only if runs still wait."""
    loop = _IN_PROCESS
    if loop is not None:
        loop.woken.set()
        return
    home = AirHome()
    store = store or RunStore()
    with _lock_file(home) as handle:
        if not _try_lock(handle):
            return
        try:
            AdmissionLoop(store).admit_pass()
            waiting = has_queued(store)
        except Exception as exc:  # the run is queued whatever happens here: the loop admits it in turn
            _log.warning("admission pass failed: %s", exc)
            waiting = True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
    if waiting:
        start_local_loop(home)


def in_process() -> bool:
    """Whether this process runs the admission loop itself (`air server`)."""
    return _IN_PROCESS is not None


def start_local_loop(home: AirHome | None = None) -> int:
    """Start the detached local loop (`python -m air.runs.admission`); returns its pid. A second one
    started at the same time finds the lock held and exits at once."""
    home = home or AirHome()
    with open(home.admission_log, "ab") as log:
        proc = subprocess.Popen(PROCESS_KINDS["admission"].argv(), stdin=subprocess.DEVNULL, stdout=log,
                                stderr=log, start_new_session=True, close_fds=True, env=_own_environ(),
                                cwd=str(home.root))
    return proc.pid


def start_in_thread(store_factory: Callable[[], RunStore], stopping: threading.Event) -> threading.Thread:
    """`air server`'s loop: one thread, holding this AIR_HOME's lock while the server runs."""
    global _IN_PROCESS
    loop = AdmissionLoop(store_factory())
    _IN_PROCESS = loop

    def serve() -> None:
        global _IN_PROCESS
        with _lock_file(AirHome()) as handle:
            while not _try_lock(handle):  # a local loop of this home still runs: it ends when its queue is empty
                if stopping.wait(loop.poll_s * 10):
                    return
            try:
                loop.run(stop=stopping)
            finally:
                _IN_PROCESS = None

    thread = threading.Thread(target=serve, name="air-admission", daemon=True)
    thread.start()
    return thread


def main() -> int:
    """The detached local loop: run while anything is queued, then exit (see the module docstring)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(process)d %(name)s: %(message)s")
    home = AirHome()
    store = RunStore()
    loop = AdmissionLoop(store)
    with _lock_file(home) as handle:
        if not _try_lock(handle):
            return 0  # another loop serves this AIR_HOME
        _log.info("admission loop of %s started", home.root)
        while True:
            if not home.runs_db.exists():  # the AIR_HOME went away: nothing can be admitted any more
                return 0
            loop.run(until_idle=True)
            fcntl.flock(handle, fcntl.LOCK_UN)
            # A run queued after the last look, by an `air run` that saw the lock held, is ours still.
            if not has_queued(store) or not _try_lock(handle):
                _log.info("admission loop of %s: nothing queued, exiting", home.root)
                return 0


if __name__ == "__main__":
    sys.exit(main())

