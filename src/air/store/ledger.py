"""The slot ledger: this machine's accelerator slots, handed out to QUEUED runs in queue order.

Queue order, per pool, is one rule: higher `priority_class` first, then first in first out (`queue_seq`).
One table (`slot_claims`, whose primary key is the guarantee: one slot, one run); every claim is one
write transaction, so two runs can never take the same slot, and "why does it wait" reads the same rule.
A CRITICAL run that is next but finds its pool full asks BEST_EFFORT runs to give their slots back in
the same transaction (preemption.py).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from typing import NamedTuple

from air.errors import GPUValidationError, NotFoundError
from air.store.schema import StoreDatabase
from air.store.states import PriorityClass, RunStatus, StatusConflictError

SLOT_KINDS = ("GPU", "CPU")
#: The claim kind of a run admitted to ask Ray for its nodes (`try_admit`); one per run, keyed by queue_seq.
ADMITTED = "RUN"


class _QueueRow(NamedTuple):
    """What the queue's rules read of one run."""

    status: RunStatus
    backend: str
    queue_seq: int | None
    pool: str | None
    user: str
    #: The slot kind its accelerator type takes ('GPU' or 'CPU').
    kind: str
    #: Its priority class's rank (states.PriorityClass.rank): higher goes first.
    priority: int


def _queue_row(conn: sqlite3.Connection, run_id: str) -> _QueueRow:
    row = conn.execute(
        "SELECT status, backend, queue_seq, pool, user, accelerator_type, priority FROM runs WHERE id = ?", (run_id,)
    ).fetchone()
    if row is None:
        raise NotFoundError(f"Run {run_id} not found.")
    return _QueueRow(RunStatus(row[0]), row[1], row[2], row[3], row[4], str(row[5]).split("_", 1)[0].upper(),
                     PriorityClass.NORMAL.rank if row[6] is None else int(row[6]))


def _ahead_params(row: _QueueRow, user_limit: int | None) -> list[object]:
    """The parameters `SlotLedger._ahead_sql` takes for the run of `row`, in its order."""
    params: list[object] = [RunStatus.QUEUED.value, row.priority, row.priority, row.queue_seq, row.backend,
                            row.kind + "\\_%", row.pool]
    if user_limit is not None:
        params.append(user_limit)
    return params


class SlotLedger(StoreDatabase):
    """The slot-ledger half of `RunStore` (claims, releases, queue order)."""

    def try_claim_slots(self, run_id: str, kind: str, count: int, capacity: int, *,
                        slots: Sequence[int] | None = None, user_limit: int | None = None) -> list[int] | None:
        """Claim `count` of this machine's `capacity` slots of `kind` ('GPU' or 'CPU') for a QUEUED run;
        only among `slots` (the run's pool) when given.

        Strictly in queue order per pool (higher priority class first, then first in first out): a run
        gets slots only when no run ahead of it (same kind, backend and pool) is still waiting without
        slots, even if enough slots are free for this one. A CRITICAL run that is next but lacks free
        slots asks BEST_EFFORT runs of its pool to give theirs back (preemption.py) and gets them on a
        later try. With `user_limit`, a run whose user already holds that many runs' slots
        waits, and does not hold up other users' runs behind it. Returns the slot indices (lowest free first), or None: not its turn or not enough
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
        allowed = list(range(capacity)) if slots is None else list(slots)
        if count > len(allowed):
            where = "this machine has" if slots is None else "its pool has"
            raise GPUValidationError(
                f"Run {run_id} needs {count} {kind} slots; {where} {len(allowed)}.",
                hint="Ask for fewer accelerators, or use a backend with more (a Ray cluster profile).",
            )
        now = self._clock()
        with self._write() as conn:
            row = _queue_row(conn, run_id)
            status, user = row.status, row.user
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
            if user_limit is not None and self._running_of(conn, user) >= user_limit:
                return None
            if self._waiting_ahead(conn, row._replace(kind=kind), user_limit, stop_at_one=True):
                return None
            used = {r[0] for r in conn.execute("SELECT slot_index FROM slot_claims WHERE slot_kind = ?", (kind,))}
            free = [i for i in allowed if i not in used]
            if len(free) < count:
                if row.priority >= PriorityClass.CRITICAL.rank:
                    from air.store.preemption import request_preemption

                    request_preemption(conn, run_id, kind=kind, backend=row.backend, pool=row.pool,
                                       allowed=allowed, needed=count - len(free))
                return None
            chosen = free[:count]
            conn.executemany(
                "INSERT INTO slot_claims (slot_kind, slot_index, run_id, claimed_at) VALUES (?, ?, ?, ?)",
                [(kind, i, run_id, now) for i in chosen],
            )
            from air.store.preemption import clear_request

            clear_request(conn, run_id)  # a preemption asked of an earlier holding is void: these slots are new
            return chosen

    def try_admit(self, run_id: str, *, user_limit: int | None = None) -> bool:
        """Let a QUEUED run of a backend that places runs itself (Ray) go ask for its nodes: strictly in
        queue order per pool (no run ahead of it of its kind, backend and pool still QUEUED, admitted or
        not, unless its user is at the limit) and within `user_limit`. (No preemption here: Ray places.) An admitted run holds one claim of kind
        RUN (counted by the per-user limit) until it ends or `release_slots`."""
        with self._write() as conn:
            row = _queue_row(conn, run_id)
            status, queue_seq, user = row.status, row.queue_seq, row.user
            if conn.execute("SELECT 1 FROM slot_claims WHERE run_id = ?", (run_id,)).fetchone():
                return True
            if status is not RunStatus.QUEUED:
                raise StatusConflictError(f"Run {run_id} is {status}, not QUEUED; it cannot be admitted.",
                                          run_id=run_id, current=status.value)
            if user_limit is not None and self._running_of(conn, user) >= user_limit:
                return False
            if self._waiting_ahead(conn, row, user_limit, stop_at_one=True, admitted_wait=True):
                return False
            conn.execute("INSERT INTO slot_claims (slot_kind, slot_index, run_id, claimed_at) VALUES (?, ?, ?, ?)",
                         (ADMITTED, queue_seq or 0, run_id, self._clock()))
            return True

    @staticmethod
    def _running_of(conn: sqlite3.Connection, user: str) -> int:
        """Runs of `user` that hold slots (starting or running): what the per-user limit counts."""
        row = conn.execute(
            "SELECT COUNT(DISTINCT c.run_id) FROM slot_claims c JOIN runs r ON r.id = c.run_id WHERE r.user = ?",
            (user,),
        ).fetchone()
        return int(row[0])

    def running_runs_of(self, user: str) -> int:
        """How many of `user`'s runs hold slots now (the per-user limit's count)."""
        return self._running_of(self._conn(), user)

    @staticmethod
    def _ahead_sql(select: str, user_limit: int | None, admitted_wait: bool = False) -> str:
        """QUEUED runs of one kind, backend and pool ahead in the queue (a higher priority class, or the
        same one and entered the queue earlier) that hold no slots (`admitted_wait`: Ray's, admitted or
        not: until placed, they still wait) and, with a per-user limit, whose user is under it: a user at
        the limit holds up no one. Parameters: `_ahead_params`."""
        sql = (
            f"SELECT {select} FROM runs r WHERE r.status = ? "
            "AND (r.priority > ? OR (r.priority = ? AND r.queue_seq < ?)) "
            "AND r.backend = ? AND r.accelerator_type LIKE ? ESCAPE '\\' AND r.pool IS ? "
            + ("AND NOT EXISTS (SELECT 1 FROM slot_claims c WHERE c.run_id = r.id)" if not admitted_wait else "")
        )
        if user_limit is not None:  # (an admitted run of that user counts; it is not the one at the limit)
            sql += (" AND ((SELECT COUNT(DISTINCT c2.run_id) FROM slot_claims c2 JOIN runs r2 ON r2.id = c2.run_id "
                    "WHERE r2.user = r.user) < ? OR EXISTS (SELECT 1 FROM slot_claims c3 WHERE c3.run_id = r.id))")
        return sql

    @classmethod
    def _waiting_ahead(
        cls, conn: sqlite3.Connection, row: _QueueRow, user_limit: int | None, *, stop_at_one: bool,
        admitted_wait: bool = False,
    ) -> int:
        """How many runs wait ahead of the run of `row` (`_ahead_sql`)."""
        if row.queue_seq is None:
            return 0
        sql = ("SELECT COUNT(*) FROM (" + cls._ahead_sql("1", user_limit, admitted_wait)
               + (" LIMIT 1)" if stop_at_one else ")"))
        return int(conn.execute(sql, _ahead_params(row, user_limit)).fetchone()[0])

    def queue_position(self, run_id: str, *, user_limit: int | None = None) -> int | None:
        """How many runs wait ahead of this QUEUED run (0: next). None if it is not waiting."""
        conn = self._conn()
        row = _queue_row(conn, run_id)
        if row.status is not RunStatus.QUEUED or self.claimed_slots(run_id):
            return None
        return self._waiting_ahead(conn, row, user_limit, stop_at_one=False)

    def queued_ahead(self, run_id: str, *, user_limit: int | None = None, admitted_wait: bool = False) -> list[str]:
        """Ids of the runs this QUEUED run waits behind (same slot kind, backend and pool, ahead in the
        queue: higher priority class or entered earlier, no slots yet, their user under `user_limit`),
        first in line first. Empty when it
        is next, holds slots or is not QUEUED. The same rule as `try_claim_slots`'s FIFO check, so "why
        does it wait" never disagrees with it."""
        conn = self._conn()
        row = _queue_row(conn, run_id)
        if row.status is not RunStatus.QUEUED or row.queue_seq is None or self.claimed_slots(run_id):
            return []
        sql = self._ahead_sql("r.id", user_limit, admitted_wait) + " ORDER BY r.priority DESC, r.queue_seq"
        return [r[0] for r in conn.execute(sql, _ahead_params(row, user_limit))]

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

