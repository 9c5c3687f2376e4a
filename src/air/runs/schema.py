"""The run store's schema and connections: DDL and its migrations, one connection per process and thread,
WAL mode, and the one write transaction (`BEGIN IMMEDIATE`) every write goes through.

`StoreDatabase` is the base `RunStore` (store.py) and its slot ledger (ledger.py) stand on; it holds no
knowledge of runs beyond the tables it creates.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

from air.errors import UserInputError

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
    (
        # `air server`'s API tokens: only a sha256 of each token is kept; a revoked token keeps its row.
        """CREATE TABLE api_tokens (
            token_sha256 TEXT PRIMARY KEY,
            token_id     TEXT NOT NULL UNIQUE,
            user         TEXT NOT NULL,
            admin        INTEGER NOT NULL DEFAULT 0,
            created_at   REAL NOT NULL,
            revoked_at   REAL
        )""",
    ),
    (
        # The pool a run waits in and runs on (config.yaml `pools:`); NULL: the whole machine (no pools).
        "ALTER TABLE runs ADD COLUMN pool TEXT",
    ),
    (
        # Walls between users (`air server`). The Unix account a token's user's runs execute as (NULL: the
        # server's choice, `air-<user>` when it runs as root).
        "ALTER TABLE api_tokens ADD COLUMN unix_user TEXT",
        # The workload's `permissions` as JSON ([{"user"|"group": NAME, "level": CAN_…}]); NULL: none given.
        "ALTER TABLE runs ADD COLUMN permissions TEXT",
        # Web sessions: the cookie holds a random id whose sha256 is kept here, never the API token.
        """CREATE TABLE web_sessions (
            session_sha256 TEXT PRIMARY KEY,
            token_id       TEXT NOT NULL,
            user           TEXT NOT NULL,
            csrf           TEXT NOT NULL,
            created_at     REAL NOT NULL,
            expires_at     REAL NOT NULL,
            revoked_at     REAL
        )""",
        # Who did what on the server: token, permission and cancel actions.
        """CREATE TABLE audit_log (
            seq    INTEGER PRIMARY KEY AUTOINCREMENT,
            at     REAL NOT NULL,
            actor  TEXT NOT NULL,
            action TEXT NOT NULL,
            target TEXT,
            detail TEXT
        )""",
        # Per-run credentials (MLflow through the server's door): only the sha256 is kept; a credential
        # reaches its own run's MLflow runs and nothing else, and dies with the run.
        """CREATE TABLE run_credentials (
            token_sha256 TEXT PRIMARY KEY,
            run_id       TEXT NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
            user         TEXT NOT NULL,
            created_at   REAL NOT NULL,
            revoked_at   REAL
        )""",
        "CREATE INDEX run_credentials_by_run ON run_credentials (run_id)",
    ),
)

SCHEMA_VERSION: int = len(_MIGRATIONS)

#: Connections inherited through fork: never used and never closed in the child (closing one there
#: can disturb the parent's locks), only kept alive.
_INHERITED: list[sqlite3.Connection] = []


class StoreDatabase:
    """Connections to the store's SQLite file. `RunStore.__init__` sets the attributes below."""

    path: Path
    busy_timeout_s: float
    _clock: Callable[[], float]
    _local: threading.local
    _migrated_in: int | None

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

    def reader(self) -> sqlite3.Connection:
        """This thread's connection, for reads of tables other modules own (the server's `api_tokens`)."""
        return self._conn()

    def writer(self) -> AbstractContextManager[sqlite3.Connection]:
        """One write transaction (BEGIN IMMEDIATE), for writes of tables other modules own."""
        return self._write()

    def close(self) -> None:
        """Close this thread's connection (others close when their thread or the process ends)."""
        conn = getattr(self._local, "conn", None)
        if conn is not None and self._local.pid == os.getpid():
            conn.close()
        self._local.conn = None


__all__ = ["SCHEMA_VERSION", "StoreDatabase"]
