"""The run store: one SQLite file (`$AIR_HOME/runs.db`) shared by every `air` process on this machine.

Boring on purpose: the standard library's sqlite3, WAL mode (readers never block the writer), a busy
timeout (writers queue instead of failing with "database is locked"), parameterised SQL only, and a
`schema_version` table with additive migrations. Every write is one `BEGIN IMMEDIATE` transaction, so a
read-then-write (a compare-and-set on the status, a slot claim) cannot interleave with another process.

Each process (and thread) opens its own connection; a store object carried across `fork` reopens.

Three tables: `runs` (one row per Run), `attempts` (one per try), and `slot_claims`, the ledger of
accelerator slots this machine's local backend hands out first-in first-out to QUEUED runs. `RunStore`
puts together records.py (`Run`, `Attempt`), schema.py (DDL, migrations, connections), ledger.py (slots)
and liveness.py (is a supervisor alive), and resolves which run an id (or a piece of one) names.
"""

from __future__ import annotations

import difflib
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Literal

from air.errors import NotFoundError, UserInputError
from air.home import AirHome
from air.store.access import LEVEL_NAMES, Viewer
from air.store.ledger import SlotLedger
from air.store.liveness import process_create_time
from air.store.paths import RUN_ID_RE, new_run_id, parse_run_id_fragment
from air.store.records import (
    ATTEMPT_SELECT,
    INSERT_RUN,
    RUN_KINDS,
    RUN_SELECT,
    Attempt,
    CreateRunResult,
    Run,
    attempt_from_row,
    current_user,
    run_from_row,
    run_values,
)
from air.store.states import (
    AttemptStatus,
    FailureClass,
    IllegalTransitionError,
    PriorityClass,
    RunStatus,
    StatusConflictError,
    check_attempt_transition,
    check_transition,
)

#: How long a writer waits for another process's transaction before giving up (seconds). Transactions
#: here last milliseconds; this only matters when dozens of `air` processes start at the same moment.
BUSY_TIMEOUT_S: float = 60.0

#: Run status → the status its still-RUNNING attempt gets when the run ends (so no attempt is left
#: RUNNING forever, e.g. after the supervisor died).
_ATTEMPT_END: dict[RunStatus, AttemptStatus] = {
    RunStatus.SUCCESS: AttemptStatus.SUCCESS,
    RunStatus.FAILED: AttemptStatus.FAILED,
    RunStatus.CANCELED: AttemptStatus.CANCELED,
    RunStatus.TIMEDOUT: AttemptStatus.TIMEDOUT,
    RunStatus.INTERNAL_ERROR: AttemptStatus.INTERNAL_ERROR,
}


# ---- the store --------------------------------------------------------------------------------------


def _visible_clause(viewer: Viewer) -> tuple[str, list[object]]:
    """SQL for "owned by `viewer` or granted to them": the same reading as access.grants_from_json (an
    entry names exactly one user or group, with a known level; malformed JSON grants nothing)."""
    groups = sorted(viewer.groups)
    levels = ", ".join("?" for _ in LEVEL_NAMES)
    entry = "runs.permissions, g.fullkey || "  # every path is read from the (valid) whole text
    in_groups = f"json_extract({entry}'.group') IN ({', '.join('?' for _ in groups)})" if groups else "0"
    clause = (
        "(user = ? OR EXISTS (SELECT 1 FROM json_each(CASE WHEN json_valid(runs.permissions) "
        "AND json_type(runs.permissions) = 'array' THEN runs.permissions ELSE '[]' END) AS g "
        f"WHERE g.type = 'object' AND json_extract({entry}'.level') IN ({levels}) AND ("
        f"(json_type({entry}'.user') = 'text' AND json_type({entry}'.group') IS NULL "
        f"AND json_extract({entry}'.user') = ?) OR "
        f"(json_type({entry}'.group') = 'text' AND json_type({entry}'.user') IS NULL AND {in_groups}))))"
    )
    return clause, [viewer.user, *LEVEL_NAMES, viewer.user, *groups]



class RunStore(SlotLedger):
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
        self.path = Path(path) if path is not None else AirHome().runs_db
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
        path = AirHome(create=False).runs_db
        return cls(path) if path.is_file() else None

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
        run_id: str | None = None, pool: str | None = None,
        permissions: str | None = None,
        priority_class: PriorityClass | str = PriorityClass.NORMAL,
    ) -> CreateRunResult:
        """Record a new PENDING run. With an `idempotency_key` already used, return that run instead
        (`existing=True`) and create nothing: a client retrying a submit never makes a duplicate.
        `permissions`: the workload's grants (access.grants_to_json); `priority_class` orders its pool's queue."""
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
                user=user if user is not None else current_user(),
                idempotency_key=idempotency_key, pool=pool, permissions=permissions,
                priority_class=PriorityClass(priority_class),
            )
            with self._write() as conn:
                if idempotency_key is not None:
                    row = conn.execute(RUN_SELECT + " WHERE idempotency_key = ?", (idempotency_key,)).fetchone()
                    if row is not None:
                        return CreateRunResult(run_from_row(row), True)
                if run_id is None and conn.execute("SELECT 1 FROM runs WHERE id = ?", (run.id,)).fetchone():
                    continue
                conn.execute(INSERT_RUN, run_values(run, None))
            return CreateRunResult(run, False)
        raise RuntimeError("could not pick an unused run id")  # pragma: no cover

    def insert_runs(self, runs: Iterable[Run]) -> int:
        """Insert finished `Run` records as they are, in one transaction (imports, benchmarks).

        No idempotency check and no defaults are applied; QUEUED runs join the queue in the given order.
        """
        count = 0
        with self._write() as conn:
            seq = conn.execute("SELECT COALESCE(MAX(queue_seq), 0) FROM runs").fetchone()[0]

            def values() -> Iterator[tuple[object, ...]]:
                nonlocal count, seq
                for run in runs:
                    count += 1
                    queue_seq = None
                    if run.status is RunStatus.QUEUED:
                        seq += 1
                        queue_seq = seq
                    yield run_values(run, queue_seq)

            conn.executemany(INSERT_RUN, values())
        return count

    def get_run(self, run_id: str) -> Run:
        """The run with this id, or with this unique id prefix, or whose 8 hex digits start so.

        NotFoundError (with "did you mean") when there is none or more than one.
        """
        conn = self._conn()
        full = self._resolve(conn, run_id)
        row = conn.execute(RUN_SELECT + " WHERE id = ?", (full,)).fetchone()
        if row is None:  # deleted in between
            raise NotFoundError(f"Run {run_id} not found.")
        return run_from_row(row)

    def _resolve(self, conn: sqlite3.Connection, text: str) -> str:
        """Which run `text` means: a full id, a unique prefix, or the 8 hex digits people copy from a table,
        with "did you mean" suggestions when it names none or several."""
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
        offset: int = 0,
        visible_to: Viewer | None = None,
    ) -> list[Run]:
        """Runs, newest first. `statuses=None` means the active ones (what `air list runs` shows);
        "all" adds the ended ones. `experiment_glob` is a case-insensitive glob (`qwen*`),
        `accelerator_type` a case-insensitive substring (`H100`, `GPU_8xH100`), `num_accelerators` and
        `user` exact, `id_prefix` the start of the run id (shell completion). Served by indexes: fast
        over 100,000 runs. `visible_to`: only the runs that viewer owns or that the run's `permissions`
        name (as user or by one of their groups): a `private` server's listing (access.Policy.list_filter)."""
        where: list[str] = []
        params: list[object] = []
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
        if visible_to is not None:
            clause, values = _visible_clause(visible_to)
            where.append(clause)
            params.extend(values)
        if id_prefix:
            where.append("id >= ? AND id < ?")  # a range on the primary key, not a scan
            params.extend([id_prefix, id_prefix + "\U0010ffff"])
        sql = RUN_SELECT
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY submitted_at DESC, id DESC"
        if limit is not None:
            if limit <= 0:
                raise UserInputError(f"limit must be a positive integer, got {limit}.")
            sql += " LIMIT ?"
            params.append(int(limit))
            if offset > 0:  # a page further down (the web page's "older"): the index is walked, not sorted
                sql += " OFFSET ?"
                params.append(int(offset))
        return [run_from_row(r) for r in self._conn().execute(sql, params)]

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
            params: list[object] = [new_status.value]
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
            row = conn.execute(RUN_SELECT + " WHERE id = ?", (run_id,)).fetchone()
        return run_from_row(row)

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

    def set_mlflow_run_id(self, run_id: str, mlflow_run_id: str, *, attempt: int | None = None,
                          experiment: str | None = None) -> None:
        """Link the run (its latest MLflow run) and, when given, that attempt to an MLflow run; with
        `experiment`, the run shows the MLflow experiment it was logged to (a call's is known only then)."""
        with self._write() as conn:
            self._status(conn, run_id)
            conn.execute("UPDATE runs SET mlflow_run_id = ? WHERE id = ?", (mlflow_run_id, run_id))
            if experiment:
                conn.execute("UPDATE runs SET experiment = ? WHERE id = ?", (experiment, run_id))
            if attempt is not None:
                cur = conn.execute(
                    "UPDATE attempts SET mlflow_run_id = ? WHERE run_id = ? AND attempt = ?",
                    (mlflow_run_id, run_id, attempt),
                )
                if cur.rowcount == 0:
                    raise NotFoundError(f"Run {run_id} has no attempt {attempt}.")

    def set_permissions(self, run_id: str, permissions: str | None) -> Run:
        """Replace who else may see or act on a run (access.grants_to_json text; None: no grants)."""
        with self._write() as conn:
            self._status(conn, run_id)
            conn.execute("UPDATE runs SET permissions = ? WHERE id = ?", (permissions, run_id))
            row = conn.execute(RUN_SELECT + " WHERE id = ?", (run_id,)).fetchone()
        return run_from_row(row)

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
            out = conn.execute(ATTEMPT_SELECT + " WHERE run_id = ? AND attempt = ?", (run_id, attempt))
            return attempt_from_row(out.fetchone())

    def get_attempt(self, run_id: str, attempt: int | None = None) -> Attempt:
        """One attempt (0-based; None = the latest). NotFoundError names the valid range."""
        rows = self.list_attempts(run_id)
        if not rows:
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
        rows = [attempt_from_row(r) for r in conn.execute(
            ATTEMPT_SELECT + " WHERE run_id = ? ORDER BY attempt", (run_id,)
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

