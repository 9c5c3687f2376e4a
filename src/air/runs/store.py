"""The run store: one SQLite file (`$AIR_HOME/runs.db`) shared by every `air` process on this machine.

Boring on purpose: the standard library's sqlite3, WAL mode (readers never block the writer), a busy
timeout (writers queue instead of failing with "database is locked"), parameterised SQL only, and a
`schema_version` table with additive migrations. Every write is one `BEGIN IMMEDIATE` transaction, so a
read-then-write (a compare-and-set on the status, a slot claim) cannot interleave with another process.

Each process (and thread) opens its own connection; a store object carried across `fork` reopens.

Three tables: `runs` (one row per Run), `attempts` (one per try), and `slot_claims`, the ledger of
accelerator slots this machine's local backend hands out first-in first-out to QUEUED runs.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, NamedTuple

from air.errors import GPUValidationError, NotFoundError, UserInputError
from air.home import air_home
from air.runs.paths import RUN_ID_RE, new_run_id, parse_run_id_fragment
from air.runs.states import (
    AttemptStatus,
    FailureClass,
    IllegalTransitionError,
    RunStatus,
    StatusConflictError,
    check_attempt_transition,
    check_transition,
)

#: How long a writer waits for another process's transaction before giving up (seconds). Transactions
#: here last milliseconds; this only matters when dozens of `air` processes start at the same moment.
BUSY_TIMEOUT_S: float = 60.0

#: The store's file name under AIR_HOME.
STORE_FILE = "runs.db"

#: What a run is: a workload YAML (`air run`), or a `@distributed` call (local, or remote=True).
RUN_KINDS = ("workload", "call")
#: Kinds older air versions wrote, read as today's: remote calls were recorded as "distributed".
_LEGACY_KINDS = {"distributed": "call"}
SLOT_KINDS = ("GPU", "CPU")

# ---- schema ---------------------------------------------------------------------------------------

#: Migration N (1-based) brings the schema from version N-1 to N. Only ever append; never edit one that
#: has shipped, never drop or rename (old `air` processes may still be reading the same file).
_MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        """CREATE TABLE runs (
            id                    TEXT PRIMARY KEY,
            experiment            TEXT NOT NULL,
            run_name              TEXT,
            status                TEXT NOT NULL,
            accelerator_type      TEXT NOT NULL,
            num_accelerators      INTEGER NOT NULL,
            num_nodes             INTEGER NOT NULL,
            backend               TEXT NOT NULL,
            profile               TEXT,
            spec                  TEXT NOT NULL DEFAULT '',
            submitted_at          REAL NOT NULL,
            started_at            REAL,
            ended_at              REAL,
            termination_reason    TEXT,
            failure_class         TEXT,
            idempotency_key       TEXT UNIQUE,
            supervisor_pid        INTEGER,
            supervisor_started_at REAL,
            mlflow_run_id         TEXT,
            user                  TEXT NOT NULL,
            kind                  TEXT NOT NULL,
            current_attempt       INTEGER,
            queue_seq             INTEGER
        )""",
        # `air list runs --all-status`: newest first, stop after --limit rows. It also carries the
        # filter columns, so a filtered listing that matches little scans this index alone and reads
        # a (large: it holds the spec) table row only for matches: twice as fast at 100,000 runs.
        "CREATE INDEX runs_by_submitted ON runs "
        "(submitted_at, id, status, experiment, accelerator_type, num_accelerators, user)",
        # `air list runs` (active only: few rows, sorted after) and the slot ledger's FIFO check
        # (QUEUED runs in queue order).
        "CREATE INDEX runs_by_status ON runs (status, queue_seq)",
        """CREATE TABLE attempts (
            run_id             TEXT NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
            attempt            INTEGER NOT NULL,
            status             TEXT NOT NULL,
            started_at         REAL NOT NULL,
            ended_at           REAL,
            termination_reason TEXT,
            failure_class      TEXT,
            exit_code          INTEGER,
            signal             INTEGER,
            mlflow_run_id      TEXT,
            PRIMARY KEY (run_id, attempt)
        )""",
        # The primary key is the guarantee: one slot, one run.
        """CREATE TABLE slot_claims (
            slot_kind  TEXT NOT NULL,
            slot_index INTEGER NOT NULL,
            run_id     TEXT NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
            claimed_at REAL NOT NULL,
            PRIMARY KEY (slot_kind, slot_index)
        )""",
        "CREATE INDEX slot_claims_by_run ON slot_claims (run_id)",
    ),
)

SCHEMA_VERSION: int = len(_MIGRATIONS)

_RUN_COLUMNS = (
    "id", "experiment", "run_name", "status", "accelerator_type", "num_accelerators", "num_nodes",
    "backend", "profile", "spec", "submitted_at", "started_at", "ended_at", "termination_reason",
    "failure_class", "idempotency_key", "supervisor_pid", "supervisor_started_at", "mlflow_run_id",
    "user", "kind", "current_attempt",
)
_RUN_SELECT = "SELECT " + ", ".join(_RUN_COLUMNS) + " FROM runs"
_ATTEMPT_SELECT = (
    "SELECT run_id, attempt, status, started_at, ended_at, termination_reason, failure_class, exit_code, "
    "signal, mlflow_run_id FROM attempts"
)

#: Connections inherited through fork: never used and never closed in the child (closing one there
#: can disturb the parent's locks), only kept alive.
_INHERITED: list[sqlite3.Connection] = []


# ---- records ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """One row of `runs`: what the user submitted and where it stands. Immutable; re-read to refresh."""

    id: str
    experiment: str
    status: RunStatus
    accelerator_type: str
    num_accelerators: int
    num_nodes: int
    submitted_at: float
    backend: str = "local"
    kind: str = "workload"
    run_name: str | None = None
    profile: str | None = None
    spec_yaml: str = field(default="", repr=False)
    user: str = ""
    started_at: float | None = None
    ended_at: float | None = None
    termination_reason: str | None = None
    failure_class: FailureClass | None = None
    idempotency_key: str | None = None
    supervisor_pid: int | None = None
    supervisor_started_at: float | None = None
    mlflow_run_id: str | None = None
    #: 0-based index of the latest attempt; None before the first one starts.
    current_attempt: int | None = None

    @property
    def is_terminal(self) -> bool:
        return self.status.is_terminal()

    @property
    def attempt_count(self) -> int:
        """Attempts started so far (retries = attempt_count - 1)."""
        return 0 if self.current_attempt is None else self.current_attempt + 1

    @property
    def slot_kind(self) -> str:
        """'GPU' or 'CPU': which slot ledger the run draws from (the accelerator type's prefix)."""
        return self.accelerator_type.split("_", 1)[0].upper()

    def duration_seconds(self, now: float | None = None) -> float | None:
        """From first start to end (or to `now` while it runs); None if it never started."""
        if self.started_at is None:
            return None
        end = self.ended_at if self.ended_at is not None else (time.time() if now is None else now)
        return max(0.0, end - self.started_at)


@dataclass(frozen=True)
class Attempt:
    """One row of `attempts`: one try of a run, with its own logs (`attempt_<index>/`) and MLflow run."""

    run_id: str
    index: int
    status: AttemptStatus
    started_at: float
    ended_at: float | None = None
    termination_reason: str | None = None
    failure_class: FailureClass | None = None
    exit_code: int | None = None
    signal: int | None = None
    mlflow_run_id: str | None = None

    @property
    def signal_name(self) -> str | None:
        """'SIGKILL' for signal 9, and so on."""
        if self.signal is None:
            return None
        import signal as _signal

        try:
            return _signal.Signals(self.signal).name
        except ValueError:
            return f"signal {self.signal}"

    def duration_seconds(self, now: float | None = None) -> float:
        end = self.ended_at if self.ended_at is not None else (time.time() if now is None else now)
        return max(0.0, end - self.started_at)


class CreateRunResult(NamedTuple):
    """What `create_run` returns: the run, and whether it already existed (idempotency key replay)."""

    run: Run
    existing: bool


def _run_from_row(row: Sequence[Any]) -> Run:
    (id_, experiment, run_name, status, accelerator_type, num_accelerators, num_nodes, backend, profile,
     spec, submitted_at, started_at, ended_at, termination_reason, failure_class, idempotency_key,
     supervisor_pid, supervisor_started_at, mlflow_run_id, user, kind, current_attempt) = row
    return Run(
        id=id_, experiment=experiment, run_name=run_name, status=RunStatus(status),
        accelerator_type=accelerator_type, num_accelerators=num_accelerators, num_nodes=num_nodes,
        backend=backend, profile=profile, spec_yaml=spec, submitted_at=submitted_at,
        started_at=started_at, ended_at=ended_at, termination_reason=termination_reason,
        failure_class=FailureClass(failure_class) if failure_class else None,
        idempotency_key=idempotency_key, supervisor_pid=supervisor_pid,
        supervisor_started_at=supervisor_started_at, mlflow_run_id=mlflow_run_id, user=user,
        kind=_LEGACY_KINDS.get(kind, kind), current_attempt=current_attempt,
    )


def _attempt_from_row(row: Sequence[Any]) -> Attempt:
    run_id, index, status, started_at, ended_at, reason, failure_class, exit_code, sig, mlflow_run_id = row
    return Attempt(
        run_id=run_id, index=index, status=AttemptStatus(status), started_at=started_at, ended_at=ended_at,
        termination_reason=reason, failure_class=FailureClass(failure_class) if failure_class else None,
        exit_code=exit_code, signal=sig, mlflow_run_id=mlflow_run_id,
    )


def _run_values(run: Run, queue_seq: int | None) -> tuple[Any, ...]:
    return (
        run.id, run.experiment, run.run_name, run.status.value, run.accelerator_type, run.num_accelerators,
        run.num_nodes, run.backend, run.profile, run.spec_yaml, run.submitted_at, run.started_at,
        run.ended_at, run.termination_reason, run.failure_class.value if run.failure_class else None,
        run.idempotency_key, run.supervisor_pid, run.supervisor_started_at, run.mlflow_run_id, run.user,
        run.kind, run.current_attempt, queue_seq,
    )


_INSERT_RUN = (
    "INSERT INTO runs (" + ", ".join(_RUN_COLUMNS) + ", queue_seq) VALUES ("
    + ", ".join("?" for _ in range(len(_RUN_COLUMNS) + 1)) + ")"
)

#: Run status → the status its still-RUNNING attempt gets when the run ends (so no attempt is left
#: RUNNING forever, e.g. after the supervisor died).
_ATTEMPT_END: dict[RunStatus, AttemptStatus] = {
    RunStatus.SUCCESS: AttemptStatus.SUCCESS,
    RunStatus.FAILED: AttemptStatus.FAILED,
    RunStatus.CANCELED: AttemptStatus.CANCELED,
    RunStatus.TIMEDOUT: AttemptStatus.TIMEDOUT,
    RunStatus.INTERNAL_ERROR: AttemptStatus.INTERNAL_ERROR,
}


def _current_user() -> str:
    import getpass

    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (containers)
        return str(os.getuid())


# ---- the store --------------------------------------------------------------------------------------


class RunStore:
    """Typed access to `runs.db`. Cheap to create; opens its connection on first use.

    `clock` returns epoch seconds; tests pass their own to order runs without sleeping.
    """

    def __init__(
        self,
        path: Path | str | None = None,
        *,
        busy_timeout_s: float = BUSY_TIMEOUT_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = Path(path) if path is not None else air_home() / STORE_FILE
        self.busy_timeout_s = busy_timeout_s
        self._clock = clock
        self._local = threading.local()
        self._migrated_in: int | None = None  # pid that checked the schema

    def __repr__(self) -> str:
        return f"RunStore({str(self.path)!r})"

    @classmethod
    def if_exists(cls) -> RunStore | None:
        """The default store when `runs.db` exists, else None: readers (the reconcile every command does,
        shell completion) must not create AIR_HOME or the database just by looking."""
        path = air_home(create=False) / STORE_FILE
        return cls(path) if path.is_file() else None

    # -- connections ----------------------------------------------------------------------------

    def _conn(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        pid = os.getpid()
        if conn is not None and self._local.pid == pid:
            return conn
        if conn is not None:  # inherited through fork
            _INHERITED.append(conn)
        conn = self._open()
        if self._migrated_in != pid:
            try:
                self._migrate(conn)
            except BaseException:
                conn.close()  # and ask again next time: a refused schema stays refused
                raise
            self._migrated_in = pid
        self._local.conn, self._local.pid = conn, pid
        return conn

    def _open(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # isolation_level=None: no implicit transactions; every write below says BEGIN IMMEDIATE itself.
        conn = sqlite3.connect(str(self.path), timeout=self.busy_timeout_s, isolation_level=None)
        # PRAGMA takes no parameters; the value is an int we computed.
        conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")
        conn.execute("PRAGMA foreign_keys = ON")
        conn.execute("PRAGMA synchronous = NORMAL")  # durable enough with WAL, much cheaper commits
        self._ensure_wal(conn)
        return conn

    def _ensure_wal(self, conn: sqlite3.Connection) -> None:
        """Switch the file to WAL once (persistent). Several processes creating it at once may collide."""
        deadline = time.monotonic() + self.busy_timeout_s
        while True:
            try:
                mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
                if str(mode).lower() == "wal":
                    return
                mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
                if str(mode).lower() == "wal":
                    return
            except sqlite3.OperationalError as err:
                if "locked" not in str(err) and "busy" not in str(err):
                    raise
            if time.monotonic() > deadline:
                raise sqlite3.OperationalError(f"could not switch {self.path} to WAL mode: database is locked")
            time.sleep(0.01)

    def _migrate(self, conn: sqlite3.Connection) -> None:
        with self._write(conn):
            conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            row = conn.execute("SELECT MAX(version) FROM schema_version").fetchone()
            current = row[0] or 0
            if current > SCHEMA_VERSION:
                raise UserInputError(
                    f"{self.path} has schema version {current}, newer than this air understands "
                    f"({SCHEMA_VERSION}).",
                    hint="Upgrade air (pip install -U air-runtime), or point AIR_HOME somewhere else.",
                )
            for version in range(current + 1, SCHEMA_VERSION + 1):
                for statement in _MIGRATIONS[version - 1]:
                    conn.execute(statement)
                conn.execute("DELETE FROM schema_version")
                conn.execute("INSERT INTO schema_version (version) VALUES (?)", (version,))

    def schema_version(self) -> int:
        """The schema version of the file (after this air's migrations ran)."""
        return int(self._conn().execute("SELECT MAX(version) FROM schema_version").fetchone()[0])

    @contextmanager
    def _write(self, conn: sqlite3.Connection | None = None) -> Iterator[sqlite3.Connection]:
        """One write transaction. IMMEDIATE takes the write lock up front: a read-then-write cannot be
        overtaken by another process, and waiting happens in the busy handler, not as an error."""
        conn = conn if conn is not None else self._conn()
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException:
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            raise
        conn.execute("COMMIT")

    def close(self) -> None:
        """Close this thread's connection (others close when their thread or the process ends)."""
        conn = getattr(self._local, "conn", None)
        if conn is not None and self._local.pid == os.getpid():
            conn.close()
        self._local.conn = None

    def __enter__(self) -> RunStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- runs -----------------------------------------------------------------------------------

    def create_run(
        self,
        *,
        experiment: str,
        accelerator_type: str,
        num_accelerators: int,
        num_nodes: int,
        spec_yaml: str = "",
        run_name: str | None = None,
        backend: str = "local",
        profile: str | None = None,
        kind: Literal["workload", "call"] = "workload",
        user: str | None = None,
        idempotency_key: str | None = None,
        run_id: str | None = None,
    ) -> CreateRunResult:
        """Record a new PENDING run. With an `idempotency_key` already used, return that run instead
        (`existing=True`) and create nothing: a client retrying a submit never makes a duplicate."""
        if kind not in RUN_KINDS:
            raise ValueError(f"kind must be one of {RUN_KINDS}, got {kind!r}")
        if run_id is not None and not RUN_ID_RE.match(run_id):
            raise ValueError(f"{run_id!r} is not a run id")
        for _ in range(8):  # a fresh id colliding with an existing one is astronomically rare; retry
            run = Run(
                id=run_id or new_run_id(self._clock()),
                experiment=experiment,
                status=RunStatus.PENDING,
                accelerator_type=accelerator_type,
                num_accelerators=num_accelerators,
                num_nodes=num_nodes,
                submitted_at=self._clock(),
                backend=backend,
                kind=kind,
                run_name=run_name,
                profile=profile,
                spec_yaml=spec_yaml,
                user=user if user is not None else _current_user(),
                idempotency_key=idempotency_key,
            )
            with self._write() as conn:
                if idempotency_key is not None:
                    row = conn.execute(_RUN_SELECT + " WHERE idempotency_key = ?", (idempotency_key,)).fetchone()
                    if row is not None:
                        return CreateRunResult(_run_from_row(row), True)
                if run_id is None and conn.execute("SELECT 1 FROM runs WHERE id = ?", (run.id,)).fetchone():
                    continue
                conn.execute(_INSERT_RUN, _run_values(run, None))
            return CreateRunResult(run, False)
        raise RuntimeError("could not pick an unused run id")  # pragma: no cover

    def insert_runs(self, runs: Iterable[Run]) -> int:
        """Insert finished `Run` records as they are, in one transaction (imports, benchmarks).

        No idempotency check and no defaults are applied; QUEUED runs join the queue in the given order.
        """
        count = 0
        with self._write() as conn:
            seq = conn.execute("SELECT COALESCE(MAX(queue_seq), 0) FROM runs").fetchone()[0]

            def values() -> Iterator[tuple[Any, ...]]:
                nonlocal count, seq
                for run in runs:
                    count += 1
                    queue_seq = None
                    if run.status is RunStatus.QUEUED:
                        seq += 1
                        queue_seq = seq
                    yield _run_values(run, queue_seq)

            conn.executemany(_INSERT_RUN, values())
        return count

    def get_run(self, run_id: str) -> Run:
        """The run with this id, or with this unique id prefix, or whose 8 hex digits start so.

        NotFoundError (with "did you mean") when there is none or more than one.
        """
        conn = self._conn()
        full = self._resolve(conn, run_id)
        row = conn.execute(_RUN_SELECT + " WHERE id = ?", (full,)).fetchone()
        if row is None:  # deleted in between
            raise NotFoundError(f"Run {run_id} not found.")
        return _run_from_row(row)

    def _resolve(self, conn: sqlite3.Connection, text: str) -> str:
        fragment = parse_run_id_fragment(text)
        if RUN_ID_RE.match(fragment):
            if conn.execute("SELECT 1 FROM runs WHERE id = ?", (fragment,)).fetchone():
                return fragment
            matches: list[str] = []
        elif fragment.startswith("r"):
            # A range on the primary key: uses the index, unlike LIKE.
            matches = [r[0] for r in conn.execute(
                "SELECT id FROM runs WHERE id >= ? AND id < ? ORDER BY submitted_at DESC LIMIT 6",
                (fragment, fragment + "\uffff"),
            )]
        else:  # the random part, which is what people copy from a table; validated hex, no GLOB syntax
            matches = [r[0] for r in conn.execute(
                "SELECT id FROM runs WHERE id GLOB ? ORDER BY submitted_at DESC LIMIT 6",
                ("run-[0-9][0-9][0-9][0-9][0-9][0-9]-" + fragment + "*",),
            )]
        if len(matches) == 1:
            return matches[0]
        if matches:
            shown = ", ".join(matches[:5]) + (", …" if len(matches) > 5 else "")
            raise NotFoundError(
                f"{text!r} matches more than one run.",
                hint=f"Did you mean one of: {shown}? Give more of the id.",
            )
        suggestions = self._suggest(conn, fragment)
        hint = f"Did you mean {' or '.join(suggestions)}? " if suggestions else ""
        raise NotFoundError(
            f"Run {text} not found.",
            hint=hint + "`air list runs --all-status` lists the runs on this machine.",
        )

    def _suggest(self, conn: sqlite3.Connection, fragment: str) -> list[str]:
        """Ids that look like a mistyped `fragment`: the longest shared prefix, else close matches."""
        import difflib

        found: list[str] = []
        if fragment.startswith("run-"):
            for cut in range(len(fragment) - 1, len("run-000000-0") - 1, -1):
                prefix = fragment[:cut]
                found = [r[0] for r in conn.execute(
                    "SELECT id FROM runs WHERE id >= ? AND id < ? ORDER BY submitted_at DESC LIMIT 3",
                    (prefix, prefix + "\uffff"),
                )]
                if found:
                    return found
        recent = [r[0] for r in conn.execute(
            "SELECT id FROM runs ORDER BY submitted_at DESC, id DESC LIMIT 1000"
        )]
        if fragment.startswith("r"):
            return difflib.get_close_matches(fragment, recent, n=3, cutoff=0.8)
        by_hex = {rid[-8:]: rid for rid in recent}
        return [by_hex[h] for h in difflib.get_close_matches(fragment, list(by_hex), n=3, cutoff=0.75)]

    def list_runs(
        self,
        *,
        statuses: Iterable[RunStatus] | Literal["all"] | None = None,
        limit: int | None = 20,
        experiment_glob: str | None = None,
        accelerator_type: str | None = None,
        num_accelerators: int | None = None,
        user: str | None = None,
        id_prefix: str | None = None,
    ) -> list[Run]:
        """Runs, newest first. `statuses=None` means the active ones (what `air list runs` shows);
        "all" adds the ended ones. `experiment_glob` is a case-insensitive glob (`qwen*`),
        `accelerator_type` a case-insensitive substring (`H100`, `GPU_8xH100`), `num_accelerators` and
        `user` exact, `id_prefix` the start of the run id (shell completion). Served by indexes: fast
        over 100,000 runs."""
        where: list[str] = []
        params: list[Any] = []
        if statuses is None:
            wanted: frozenset[RunStatus] | None = RunStatus.active()
        elif statuses == "all":
            wanted = None
        else:
            wanted = frozenset(RunStatus(s) for s in statuses)
        if wanted is not None:
            if not wanted:
                return []
            where.append("status IN (" + ", ".join("?" for _ in wanted) + ")")
            params.extend(sorted(s.value for s in wanted))
        if experiment_glob:
            where.append("lower(experiment) GLOB ?")
            params.append(experiment_glob.lower())
        if accelerator_type:
            where.append("instr(lower(accelerator_type), ?) > 0")
            params.append(accelerator_type.lower())
        if num_accelerators is not None:
            where.append("num_accelerators = ?")
            params.append(int(num_accelerators))
        if user is not None:
            where.append("user = ?")
            params.append(user)
        if id_prefix:
            where.append("id >= ? AND id < ?")  # a range on the primary key, not a scan
            params.extend([id_prefix, id_prefix + "\U0010ffff"])
        sql = _RUN_SELECT
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY submitted_at DESC, id DESC"
        if limit is not None:
            if limit <= 0:
                raise UserInputError(f"limit must be a positive integer, got {limit}.")
            sql += " LIMIT ?"
            params.append(int(limit))
        return [_run_from_row(r) for r in self._conn().execute(sql, params)]

    def transition(
        self,
        run_id: str,
        new_status: RunStatus,
        *,
        reason: str | None = None,
        failure_class: FailureClass | None = None,
        expected_from: RunStatus | Iterable[RunStatus] | None = None,
    ) -> Run:
        """Move a run to `new_status` atomically and return it as it now is.

        `expected_from` makes it a compare-and-set: if the run is in another state (someone moved it
        first), StatusConflictError and nothing changes. A transition the state machine forbids raises
        IllegalTransitionError. Side effects in the same transaction: RUNNING sets `started_at` (first
        time), QUEUED takes a place in the FIFO queue (kept across retries), a terminal state sets
        `ended_at`, releases the run's slots and ends an attempt still marked RUNNING. A `reason` /
        `failure_class` given is recorded; SUCCESS clears them.
        """
        new_status = RunStatus(new_status)
        expected: frozenset[RunStatus] | None
        if expected_from is None:
            expected = None
        elif isinstance(expected_from, RunStatus | str):
            expected = frozenset({RunStatus(expected_from)})
        else:
            expected = frozenset(RunStatus(s) for s in expected_from)
        now = self._clock()
        with self._write() as conn:
            current = self._status(conn, run_id)
            if expected is not None and current not in expected:
                want = " or ".join(sorted(s.value for s in expected))
                raise StatusConflictError(
                    f"Run {run_id} is {current}, not {want}; it was not moved to {new_status}.",
                    run_id=run_id, current=current.value, requested=new_status.value,
                )
            check_transition(current, new_status, run_id=run_id)
            sets = ["status = ?"]
            params: list[Any] = [new_status.value]
            if new_status is RunStatus.SUCCESS:
                sets += ["termination_reason = NULL", "failure_class = NULL"]
            else:
                if reason is not None:
                    sets.append("termination_reason = ?")
                    params.append(reason)
                if failure_class is not None:
                    sets.append("failure_class = ?")
                    params.append(FailureClass(failure_class).value)
            if new_status is RunStatus.RUNNING:
                sets.append("started_at = COALESCE(started_at, ?)")
                params.append(now)
            if new_status is RunStatus.QUEUED:
                sets.append("queue_seq = COALESCE(queue_seq, (SELECT COALESCE(MAX(queue_seq), 0) + 1 FROM runs))")
            if new_status.is_terminal():
                sets.append("ended_at = ?")
                params.append(now)
            conn.execute("UPDATE runs SET " + ", ".join(sets) + " WHERE id = ?", (*params, run_id))
            if new_status.is_terminal():
                conn.execute("DELETE FROM slot_claims WHERE run_id = ?", (run_id,))
                conn.execute(
                    "UPDATE attempts SET status = ?, ended_at = ?, "
                    "termination_reason = COALESCE(termination_reason, ?), "
                    "failure_class = COALESCE(failure_class, ?) WHERE run_id = ? AND status = ?",
                    (
                        _ATTEMPT_END[new_status].value, now,
                        None if new_status is RunStatus.SUCCESS else reason,
                        None if new_status is RunStatus.SUCCESS or failure_class is None
                        else FailureClass(failure_class).value,
                        run_id, AttemptStatus.RUNNING.value,
                    ),
                )
            row = conn.execute(_RUN_SELECT + " WHERE id = ?", (run_id,)).fetchone()
        return _run_from_row(row)

    def _status(self, conn: sqlite3.Connection, run_id: str) -> RunStatus:
        row = conn.execute("SELECT status FROM runs WHERE id = ?", (run_id,)).fetchone()
        if row is None:
            raise NotFoundError(f"Run {run_id} not found.")
        return RunStatus(row[0])

    def set_supervisor(self, run_id: str, pid: int, started_at: float | None = None) -> None:
        """Record the supervisor's pid and its process create time (read now if not given), so a later
        `air` command can tell "our supervisor died" from "that pid now belongs to someone else"."""
        if started_at is None:
            started_at = process_create_time(pid)
            if started_at is None:
                raise ValueError(f"process {pid} does not exist")
        with self._write() as conn:
            self._status(conn, run_id)
            conn.execute(
                "UPDATE runs SET supervisor_pid = ?, supervisor_started_at = ? WHERE id = ?",
                (pid, started_at, run_id),
            )

    def set_mlflow_run_id(self, run_id: str, mlflow_run_id: str, *, attempt: int | None = None) -> None:
        """Link the run (its latest MLflow run) and, when given, that attempt to an MLflow run."""
        with self._write() as conn:
            self._status(conn, run_id)
            conn.execute("UPDATE runs SET mlflow_run_id = ? WHERE id = ?", (mlflow_run_id, run_id))
            if attempt is not None:
                cur = conn.execute(
                    "UPDATE attempts SET mlflow_run_id = ? WHERE run_id = ? AND attempt = ?",
                    (mlflow_run_id, run_id, attempt),
                )
                if cur.rowcount == 0:
                    raise NotFoundError(f"Run {run_id} has no attempt {attempt}.")

    # -- attempts -------------------------------------------------------------------------------

    def start_attempt(self, run_id: str, *, mlflow_run_id: str | None = None) -> Attempt:
        """Open the next attempt (0, 1, …) as RUNNING and make it the run's current one.

        Refused (IllegalTransitionError) while the previous attempt is still RUNNING or the run ended.
        """
        now = self._clock()
        with self._write() as conn:
            status = self._status(conn, run_id)
            if status.is_terminal():
                raise IllegalTransitionError(
                    f"Run {run_id} already ended ({status}); it cannot start another attempt.",
                    run_id=run_id, current=status.value,
                )
            last = conn.execute(
                "SELECT attempt, status FROM attempts WHERE run_id = ? ORDER BY attempt DESC LIMIT 1",
                (run_id,),
            ).fetchone()
            if last is not None and last[1] == AttemptStatus.RUNNING.value:
                raise IllegalTransitionError(
                    f"Attempt {last[0]} of run {run_id} is still RUNNING; finish it first.", run_id=run_id
                )
            index = 0 if last is None else last[0] + 1
            conn.execute(
                "INSERT INTO attempts (run_id, attempt, status, started_at, mlflow_run_id) VALUES (?, ?, ?, ?, ?)",
                (run_id, index, AttemptStatus.RUNNING.value, now, mlflow_run_id),
            )
            conn.execute("UPDATE runs SET current_attempt = ? WHERE id = ?", (index, run_id))
            if mlflow_run_id is not None:
                conn.execute("UPDATE runs SET mlflow_run_id = ? WHERE id = ?", (mlflow_run_id, run_id))
        return Attempt(run_id=run_id, index=index, status=AttemptStatus.RUNNING, started_at=now,
                       mlflow_run_id=mlflow_run_id)

    def finish_attempt(
        self,
        run_id: str,
        attempt: int,
        status: AttemptStatus,
        *,
        reason: str | None = None,
        failure_class: FailureClass | None = None,
        exit_code: int | None = None,
        signal: int | None = None,
    ) -> Attempt:
        """End a RUNNING attempt once, with its outcome. Ending it twice is IllegalTransitionError."""
        status = AttemptStatus(status)
        now = self._clock()
        with self._write() as conn:
            row = conn.execute(
                "SELECT status FROM attempts WHERE run_id = ? AND attempt = ?", (run_id, attempt)
            ).fetchone()
            if row is None:
                self._status(conn, run_id)  # NotFoundError for the run itself first
                raise NotFoundError(f"Run {run_id} has no attempt {attempt}.")
            check_attempt_transition(
                AttemptStatus(row[0]), status, what=f"Attempt {attempt} of run {run_id}"
            )
            conn.execute(
                "UPDATE attempts SET status = ?, ended_at = ?, termination_reason = ?, failure_class = ?, "
                "exit_code = ?, signal = ? WHERE run_id = ? AND attempt = ?",
                (status.value, now, reason, FailureClass(failure_class).value if failure_class else None,
                 exit_code, signal, run_id, attempt),
            )
            out = conn.execute(_ATTEMPT_SELECT + " WHERE run_id = ? AND attempt = ?", (run_id, attempt))
            return _attempt_from_row(out.fetchone())

    def get_attempt(self, run_id: str, attempt: int | None = None) -> Attempt:
        """One attempt (0-based; None = the latest). NotFoundError names the valid range."""
        conn = self._conn()
        rows = [_attempt_from_row(r) for r in conn.execute(
            _ATTEMPT_SELECT + " WHERE run_id = ? ORDER BY attempt", (run_id,)
        )]
        if not rows:
            self._status(conn, run_id)
            raise NotFoundError(f"Run {run_id} has not started an attempt yet.")
        if attempt is None:
            return rows[-1]
        if attempt < 0 or attempt >= len(rows):
            raise NotFoundError(
                f"Run {run_id} has no attempt {attempt}.",
                hint=f"Attempts are numbered 0 to {len(rows) - 1}.",
            )
        return rows[attempt]

    def list_attempts(self, run_id: str) -> list[Attempt]:
        """Every attempt of a run, oldest first (empty before the first starts)."""
        conn = self._conn()
        rows = [_attempt_from_row(r) for r in conn.execute(
            _ATTEMPT_SELECT + " WHERE run_id = ? ORDER BY attempt", (run_id,)
        )]
        if not rows:
            self._status(conn, run_id)
        return rows

    # -- housekeeping (`air prune`) -------------------------------------------------------------

    def ended_before(self, cutoff: float) -> list[tuple[str, float]]:
        """`(run_id, ended_at)` of every ended run that ended (or, lacking an end, was submitted) before
        `cutoff` (epoch seconds), oldest first: what `air prune` may remove."""
        terminal = sorted(s.value for s in RunStatus.terminal())
        sql = (
            "SELECT id, COALESCE(ended_at, submitted_at) AS ended FROM runs WHERE status IN ("
            + ", ".join("?" for _ in terminal) + ") AND COALESCE(ended_at, submitted_at) < ? ORDER BY ended, id"
        )
        return [(str(r[0]), float(r[1])) for r in self._conn().execute(sql, [*terminal, cutoff])]

    def delete_ended_runs(self, run_ids: Iterable[str]) -> list[str]:
        """Delete these runs' rows (attempts and slot claims too), but only those that are still ended:
        a run is never removed while it is active. Returns the ids deleted."""
        terminal = sorted(s.value for s in RunStatus.terminal())
        marks = ", ".join("?" for _ in terminal)
        deleted: list[str] = []
        with self._write() as conn:
            for run_id in run_ids:
                gone = conn.execute(f"DELETE FROM runs WHERE id = ? AND status IN ({marks})", [run_id, *terminal])
                if gone.rowcount:
                    conn.execute("DELETE FROM attempts WHERE run_id = ?", (run_id,))
                    conn.execute("DELETE FROM slot_claims WHERE run_id = ?", (run_id,))
                    deleted.append(run_id)
        return deleted

    # -- the slot ledger ------------------------------------------------------------------------

    def try_claim_slots(self, run_id: str, kind: str, count: int, capacity: int) -> list[int] | None:
        """Claim `count` of this machine's `capacity` slots of `kind` ('GPU' or 'CPU') for a QUEUED run.

        Strictly first in first out: a run gets slots only when no run that entered the queue before
        it (same kind, same backend) is still waiting without slots, even if enough slots are free for
        this one. Returns the slot indices (lowest free first), or None: not its turn or not enough
        free yet; try again later. A run that already holds slots gets them back (and one that gave
        them back while still QUEUED waits again, at its old place). A run no longer
        QUEUED (canceled meanwhile) raises StatusConflictError; a `count` above `capacity` can never be
        met and raises GPUValidationError.
        """
        kind = kind.upper()
        if kind not in SLOT_KINDS:
            raise ValueError(f"slot kind must be one of {SLOT_KINDS}, got {kind!r}")
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        if count > capacity:
            raise GPUValidationError(
                f"Run {run_id} needs {count} {kind} slots; this machine has {capacity}.",
                hint="Ask for fewer accelerators, or use a backend with more (a Ray cluster profile).",
            )
        now = self._clock()
        with self._write() as conn:
            row = conn.execute("SELECT status, backend, queue_seq FROM runs WHERE id = ?", (run_id,)).fetchone()
            if row is None:
                raise NotFoundError(f"Run {run_id} not found.")
            status, backend, queue_seq = RunStatus(row[0]), row[1], row[2]
            held = [r[0] for r in conn.execute(
                "SELECT slot_index FROM slot_claims WHERE run_id = ? ORDER BY slot_index", (run_id,)
            )]
            if held:
                return held
            if status is not RunStatus.QUEUED:
                raise StatusConflictError(
                    f"Run {run_id} is {status}, not QUEUED; it cannot claim slots.",
                    run_id=run_id, current=status.value,
                )
            if self._waiting_ahead(conn, kind, backend, queue_seq, stop_at_one=True):
                return None
            used = {r[0] for r in conn.execute("SELECT slot_index FROM slot_claims WHERE slot_kind = ?", (kind,))}
            free = [i for i in range(capacity) if i not in used]
            if len(free) < count:
                return None
            chosen = free[:count]
            conn.executemany(
                "INSERT INTO slot_claims (slot_kind, slot_index, run_id, claimed_at) VALUES (?, ?, ?, ?)",
                [(kind, i, run_id, now) for i in chosen],
            )
            return chosen

    @staticmethod
    def _waiting_ahead(
        conn: sqlite3.Connection, kind: str, backend: str, queue_seq: int | None, *, stop_at_one: bool
    ) -> int:
        """QUEUED runs of this kind and backend that entered the queue earlier and hold no slots."""
        if queue_seq is None:
            return 0
        sql = (
            "SELECT COUNT(*) FROM (SELECT 1 FROM runs r WHERE r.status = ? AND r.queue_seq < ? "
            "AND r.backend = ? AND r.accelerator_type LIKE ? ESCAPE '\\' "
            "AND NOT EXISTS (SELECT 1 FROM slot_claims c WHERE c.run_id = r.id)"
            + (" LIMIT 1)" if stop_at_one else ")")
        )
        row = conn.execute(sql, (RunStatus.QUEUED.value, queue_seq, backend, kind + "\\_%")).fetchone()
        return int(row[0])

    def queue_position(self, run_id: str) -> int | None:
        """How many runs wait ahead of this QUEUED run (0: next). None if it is not waiting."""
        conn = self._conn()
        row = conn.execute(
            "SELECT status, backend, queue_seq, accelerator_type FROM runs WHERE id = ?", (run_id,)
        ).fetchone()
        if row is None:
            raise NotFoundError(f"Run {run_id} not found.")
        if row[0] != RunStatus.QUEUED.value or self.claimed_slots(run_id):
            return None
        kind = str(row[3]).split("_", 1)[0].upper()
        return self._waiting_ahead(conn, kind, row[1], row[2], stop_at_one=False)

    def queued_ahead(self, run_id: str) -> list[str]:
        """Ids of the runs this QUEUED run waits behind (same slot kind and backend, entered the queue
        earlier, no slots yet), first in line first. Empty when it is next, holds slots or is not QUEUED.
        The same rule as `try_claim_slots`'s FIFO check, so "why does it wait" never disagrees with it."""
        conn = self._conn()
        row = conn.execute(
            "SELECT status, backend, queue_seq, accelerator_type FROM runs WHERE id = ?", (run_id,)
        ).fetchone()
        if row is None:
            raise NotFoundError(f"Run {run_id} not found.")
        if row[0] != RunStatus.QUEUED.value or row[2] is None or self.claimed_slots(run_id):
            return []
        kind = str(row[3]).split("_", 1)[0].upper()
        return [r[0] for r in conn.execute(
            "SELECT r.id FROM runs r WHERE r.status = ? AND r.queue_seq < ? AND r.backend = ? "
            "AND r.accelerator_type LIKE ? ESCAPE '\\' "
            "AND NOT EXISTS (SELECT 1 FROM slot_claims c WHERE c.run_id = r.id) ORDER BY r.queue_seq",
            (RunStatus.QUEUED.value, row[2], row[1], kind + "\\_%"),
        )]

    def release_slots(self, run_id: str) -> list[int]:
        """Give back every slot the run holds (idempotent); returns the indices released."""
        with self._write() as conn:
            held = [r[0] for r in conn.execute(
                "SELECT slot_index FROM slot_claims WHERE run_id = ? ORDER BY slot_index", (run_id,)
            )]
            conn.execute("DELETE FROM slot_claims WHERE run_id = ?", (run_id,))
        return held

    def claimed_slots(self, run_id: str) -> list[int]:
        """The slot indices the run holds now, in order (empty if none)."""
        return [r[0] for r in self._conn().execute(
            "SELECT slot_index FROM slot_claims WHERE run_id = ? ORDER BY slot_index", (run_id,)
        )]

    def slot_holders(self, kind: str) -> dict[int, str]:
        """Slot index → run id, for every claimed slot of `kind` (for messages like "slots 0-1: run-…")."""
        return {r[0]: r[1] for r in self._conn().execute(
            "SELECT slot_index, run_id FROM slot_claims WHERE slot_kind = ? ORDER BY slot_index",
            (kind.upper(),),
        )}


# ---- processes ---------------------------------------------------------------------------------------


def process_create_time(pid: int) -> float | None:
    """The create time of process `pid` (epoch seconds), or None if there is no such process."""
    import psutil

    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied, ValueError):
        return None


def supervisor_alive(run: Run, *, tolerance_s: float = 1.0) -> bool | None:
    """Is the run's recorded supervisor still running — the same process, not a reused pid?

    None when no supervisor was recorded yet (a run just submitted); False when the pid is gone, a
    zombie, or now belongs to a process created at another time.
    """
    if run.supervisor_pid is None or run.supervisor_started_at is None:
        return None
    import psutil

    try:
        proc = psutil.Process(run.supervisor_pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return abs(proc.create_time() - run.supervisor_started_at) <= tolerance_s
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:
        return True  # it exists and we cannot tell more: never declare a supervisor dead on a guess


# Field names of the records, for callers that render them (the CLI's --json).
RUN_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(Run))
ATTEMPT_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(Attempt))

__all__ = [
    "ATTEMPT_FIELDS",
    "Attempt",
    "BUSY_TIMEOUT_S",
    "CreateRunResult",
    "RUN_FIELDS",
    "Run",
    "RunStore",
    "SCHEMA_VERSION",
    "process_create_time",
    "supervisor_alive",
]
