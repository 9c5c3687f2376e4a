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

from air.errors import StoreError, UserInputError

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
    (
        # Priorities and preemption (issue 26): the run's `compute.priority_class` as its rank
        # (states.PriorityClass: 0 best effort, 100 normal, 200 critical), which orders its pool's queue;
        # the CRITICAL run that asked it to give its slots back (NULL: none; cleared once it is back in
        # the queue); and how many of its attempts were preempted (they do not count as retries).
        "ALTER TABLE runs ADD COLUMN priority INTEGER NOT NULL DEFAULT 100",
        "ALTER TABLE runs ADD COLUMN preempted_by TEXT",
        "ALTER TABLE runs ADD COLUMN preemptions INTEGER NOT NULL DEFAULT 0",
    ),
    (
        # `for_each` sweeps (runs/sweep_tasks.py owns the table): one row per task of a parent run, with the
        # child run that carries it out (NULL until it is submitted) and the task's parameter item as JSON.
        """CREATE TABLE sweep_tasks (
            parent_run_id TEXT NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
            task_index    INTEGER NOT NULL,
            child_run_id  TEXT UNIQUE REFERENCES runs (id) ON DELETE SET NULL,
            item          TEXT NOT NULL,
            PRIMARY KEY (parent_run_id, task_index)
        )""",
    ),
    (
        # Incremental reconcile (runs/reconcile.py): the QUEUED runs that have a supervisor to check, without
        # reading the rows that wait for the admission loop (QUEUED, no supervisor: 5,000 of them or more).
        # Partial: only the (few) supervised rows, and no other query's plan changes.
        "CREATE INDEX runs_supervised ON runs (status) WHERE supervisor_pid IS NOT NULL",
    ),
    (
        # The local admission loop restarted when killed (runs/admission.py `ensure_loop`): 1 on a run that
        # `air run` queued for this AIR_HOME's local loop (not a server's run, not a row written by hand), so
        # any command that finds one waiting without a live loop starts one. Partial index: those rows only.
        "ALTER TABLE runs ADD COLUMN local_admission INTEGER NOT NULL DEFAULT 0",
        "CREATE INDEX runs_local_admission ON runs (status) WHERE local_admission = 1",
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
            if not self._stale_immutable(conn):
                return conn
            conn.close()  # a writer came (or wrote) since: read the file afresh
            conn = self._local.conn = None
        if conn is not None:  # inherited through fork
            _INHERITED.append(conn)
        try:
            conn = self._open()
        except sqlite3.Error as err:
            raise store_error(self.path, err, busy_timeout_s=self.busy_timeout_s) from err
        if self._migrated_in != pid:
            try:
                self._migrate(conn)
            except BaseException as err:
                conn.close()  # and ask again next time: a refused schema stays refused
                if isinstance(err, sqlite3.Error):
                    raise store_error(self.path, err, busy_timeout_s=self.busy_timeout_s) from err
                raise
            self._migrated_in = pid
        self._local.conn, self._local.pid = conn, pid
        return conn

    def _open(self) -> sqlite3.Connection:
        if self.read_only():
            return self._open_read_only()
        self._refuse_emptied()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise _unwritable(self.path, str(err)) from err
        # isolation_level=None: no implicit transactions; every write below says BEGIN IMMEDIATE itself.
        conn = sqlite3.connect(str(self.path), timeout=self.busy_timeout_s, isolation_level=None)
        # PRAGMA takes no parameters; the value is an int we computed.
        conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")
        conn.execute("PRAGMA foreign_keys = ON")
        conn.execute("PRAGMA synchronous = NORMAL")  # durable enough with WAL, much cheaper commits
        self._ensure_wal(conn)
        return conn

    def read_only(self) -> bool:
        """Whether the store exists but this process may not write it (a read-only mount, another account's
        AIR_HOME): then it is opened for reading only, so `air list runs` and `air get run` still work."""
        if not self.path.is_file():
            return False
        folder_ok = os.access(self.path.parent, os.W_OK)
        return not (folder_ok and os.access(self.path, os.W_OK))

    def _open_read_only(self) -> sqlite3.Connection:
        """A reader that writes nothing. WAL readers need the `-shm` index: with it (a writer is or was
        there) SQLite reads it read-only; without it, in a folder this account cannot write (SQLite cannot
        make the index: SQLITE_READONLY_DIRECTORY or CANTOPEN), the file is whole once the last writer
        closed cleanly (no `-wal` left), so it is opened as immutable: SQLite then reads the main file alone
        and makes nothing beside it. `_stale_immutable` reopens such a reader once the file changes."""
        uri = self.path.resolve().as_uri()
        self._local.immutable_stamp = None
        for attempt in range(50):  # a writer may come or go between the tries: each state has its way in
            if attempt:
                time.sleep(0.05)
            conn = sqlite3.connect(f"{uri}?mode=ro", uri=True, timeout=self.busy_timeout_s, isolation_level=None)
            try:
                conn.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchall()
            except sqlite3.OperationalError as err:
                conn.close()
                if not _no_wal_index(err):
                    raise
                found = self._open_immutable(uri)
                if found is None:
                    continue
                conn = found
            conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")
            return conn
        raise StoreError(
            f"The run store {self.path} is read-only for this account and has writes in its "
            f"{self.path.name}-wal that no writer has folded in, with no {self.path.name}-shm index to read "
            "them by (a writer stopped without closing the store).",
            hint=f"Run any air command once as the account that owns {self.path.parent} (air list runs): it "
            "folds the log in; then read it from this account again.")

    def _open_immutable(self, uri: str) -> sqlite3.Connection | None:
        """The main file alone, when no `-wal` holds writes beyond it (None: one does; try again)."""
        wal = Path(f"{self.path}-wal")
        try:
            if wal.stat().st_size > 0:
                return None
        except FileNotFoundError:
            pass
        stamp = _stamp(self.path)
        conn = sqlite3.connect(f"{uri}?mode=ro&immutable=1", uri=True, timeout=self.busy_timeout_s,
                               isolation_level=None)
        conn.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchall()
        self._local.immutable_stamp = stamp
        return conn

    def _stale_immutable(self, conn: sqlite3.Connection) -> bool:
        """Whether this thread's reader is an immutable one whose file has changed since it was opened (a
        writer came, or checkpointed into the main file): SQLite trusts an immutable file never to change,
        so such a reader is closed and opened again rather than read from its cache."""
        stamp = getattr(self._local, "immutable_stamp", None)
        if stamp is None:
            return False
        try:
            changed = Path(f"{self.path}-wal").exists() or _stamp(self.path) != stamp
        except OSError:  # removed or replaced: opening it again says what is wrong
            changed = True
        if changed:
            self._local.immutable_stamp = None
            return True
        return False

    def _refuse_emptied(self) -> None:
        """A 0-byte `runs.db` beside run folders is a store that was truncated or replaced, not a new one:
        taking it as empty would hide every run those folders hold."""
        try:
            empty = self.path.is_file() and self.path.stat().st_size == 0
        except OSError:
            return
        if not empty:
            return
        from air.home import AirHome

        home = AirHome(self.path.parent, create=False)
        folders = [p for root in (home.runs, home.calls) if root.is_dir() for p in root.iterdir() if p.is_dir()]
        if folders:
            raise StoreError(
                f"The run store {self.path} is empty (0 bytes), but {len(folders)} run folder(s) sit beside it "
                f"under {home.runs} and {home.calls}: the store was truncated or replaced, and taking it as a new "
                "one would hide those runs.",
                hint=f"Restore {self.path.name} from a backup; or, to start a new store that lists none of them, "
                f"remove the empty file: rm {self.path}",
            )

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
        if self.read_only():
            self._check_read_only_schema(conn)
            return
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

    def _check_read_only_schema(self, conn: sqlite3.Connection) -> None:
        """A store opened for reading cannot be migrated: it is read as it is only if it is this air's schema."""
        try:
            current = conn.execute("SELECT MAX(version) FROM schema_version").fetchone()[0] or 0
        except sqlite3.OperationalError as err:
            if "no such table" not in str(err):
                raise
            current = 0
        if current != SCHEMA_VERSION:
            raise StoreError(
                f"The run store {self.path} is read-only for this process and has schema version {current}; "
                f"this air reads version {SCHEMA_VERSION}.",
                hint="Run an air command once as the account that can write it (it upgrades the file), "
                "or use the air version that wrote it.",
            )

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
        self._local.immutable_stamp = None


def _no_wal_index(err: sqlite3.OperationalError) -> bool:
    """SQLite could not open or make the store's `-shm` WAL index for a read-only reader."""
    name = str(getattr(err, "sqlite_errorname", ""))
    return name.startswith(("SQLITE_READONLY", "SQLITE_CANTOPEN")) or "unable to open" in str(err)


def _stamp(path: Path) -> tuple[int, int, int]:
    """What changes when a writer writes the main file: its inode, size and modification time."""
    st = path.stat()
    return st.st_ino, st.st_size, st.st_mtime_ns


def _unwritable(path: Path, detail: str) -> StoreError:
    whose = ""
    if path.exists() and not (os.access(path, os.W_OK) and os.access(path.parent, os.W_OK)):
        import getpass

        whose = f": it is read-only for this account ({getpass.getuser()})"
    return StoreError(
        f"The run store {path} cannot be written ({detail}){whose}.",
        hint=f"Reading works without writing (air list runs, air get run, air logs); submitting, canceling and "
        f"pruning change the store. Run as the account that owns {path.parent}, make it writable, or point "
        "AIR_HOME at a writable folder.",
    )


def store_error(path: Path, err: sqlite3.Error | OSError, *, busy_timeout_s: float | None = None) -> StoreError:
    """SQLite's own words about the store as one that names the file, says what is wrong with it (corrupt,
    unwritable, locked, full) and what to do."""
    text = str(err)
    lowered = text.lower()
    if "not a database" in lowered or "malformed" in lowered or "disk image" in lowered:
        from air.home import AirHome

        return StoreError(
            f"The run store {path} is corrupt: {text}.",
            hint=f"Move it aside and air starts a new, empty store: mv {path} {path}.corrupt   "
            f"(the run folders under {AirHome(path.parent, create=False).runs} stay, but the new store does not list them). "
            f"Or restore {path.name} from a backup; `sqlite3 {path}.corrupt .recover` may save its rows.",
        )
    if "readonly" in lowered or "read-only" in lowered or "permission" in lowered or "unable to open" in lowered:
        return _unwritable(path, text)
    if "locked" in lowered or "busy" in lowered:
        waited = f" for more than {busy_timeout_s:g}s" if busy_timeout_s else ""
        return StoreError(
            f"The run store {path} is locked: another process has held its write lock{waited} ({text}).",
            hint=f"Find it with: fuser -v {path}  (often a `sqlite3` shell or a stuck air process); end it, "
            "then run the command again.",
        )
    if "full" in lowered:
        return StoreError(f"The run store {path} cannot grow: {text}.",
                          hint=f"Free space on the disk that holds {path.parent} (air prune removes old runs).")
    return StoreError(f"The run store {path} failed: {type(err).__name__}: {text}.",
                      hint="Run again with -v for the traceback; if it persists, report it with that output.")

