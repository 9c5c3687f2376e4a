"""Preemption: a CRITICAL run that is next in its pool's queue but finds the pool full takes the slots of
BEST_EFFORT runs.

The ledger asks (`request_preemption`, inside the CRITICAL run's claim transaction, so two claims never
pick victims twice): it marks as few BEST_EFFORT runs of the pool as free enough slots, the newest
first, by setting their `preempted_by`. The victim's controller, which already reads its run's row at
every poll of its attempt (runs/controller.py), sees the mark, ends the attempt's whole process tree,
records the attempt PREEMPTED and puts the run back in the queue at its old place (`requeued`); the
slots it gives back go to the CRITICAL run, which is ahead of it. When re-admitted, the run resumes
from AIR_CHECKPOINT_DIR like a retry, but a preemption is not a retry: it does not count against
`max_retries` (`Run.preemptions`).

A row state rather than a signal: the supervisor may be on the other side of a server restart, the
mark is durable, and the controller's poll is the one place that already ends attempts (cancel, hang).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence

from air.store.states import PriorityClass, RunStatus


def request_preemption(conn: sqlite3.Connection, run_id: str, *, kind: str, backend: str, pool: str | None,
                       allowed: Sequence[int], needed: int) -> list[str]:
    """In the ledger's write transaction: mark BEST_EFFORT runs holding slots of `kind` among `allowed`
    (the pool's) so that `needed` more slots will come free for the CRITICAL run `run_id`. Slots of runs
    already asked count first; then the newest claims, as few runs as needed. Nothing is marked when all
    of them together would not free enough (the run waits like any other). Returns the runs marked now."""
    allowed_set = set(allowed)
    holders: dict[str, int] = {}
    asked: dict[str, int] = {}
    candidates: list[str] = []
    rows = conn.execute(
        "SELECT r.id, r.preempted_by, c.slot_index FROM slot_claims c JOIN runs r ON r.id = c.run_id "
        "WHERE c.slot_kind = ? AND r.backend = ? AND r.pool IS ? AND r.priority < ? AND r.status IN (?, ?) "
        "ORDER BY c.claimed_at DESC, r.queue_seq DESC",
        (kind, backend, pool, PriorityClass.NORMAL.rank, RunStatus.QUEUED.value, RunStatus.RUNNING.value),
    ).fetchall()
    for victim, preempted_by, slot in rows:
        if slot not in allowed_set:
            continue
        target = asked if preempted_by is not None else holders
        if victim not in target:
            if target is holders:
                candidates.append(victim)
            target[victim] = 0
        target[victim] += 1
    coming = sum(asked.values())
    if coming >= needed or coming + sum(holders.values()) < needed:
        return []
    marked: list[str] = []
    for victim in candidates:  # newest claim first
        if coming >= needed:
            break
        conn.execute("UPDATE runs SET preempted_by = ? WHERE id = ? AND preempted_by IS NULL", (run_id, victim))
        marked.append(victim)
        coming += holders[victim]
    return marked


def requeued(conn: sqlite3.Connection, run_id: str) -> None:
    """The preempted run's attempt ended and it is going back to the queue: clear the mark and count the
    preemption (it is not a retry)."""
    conn.execute("UPDATE runs SET preempted_by = NULL, preemptions = preemptions + 1 WHERE id = ?", (run_id,))


def clear_request(conn: sqlite3.Connection, run_id: str) -> None:
    """Drop the run's mark: its attempt ended by itself before it could be preempted (or the run was
    canceled), or it claims slots afresh (the ledger)."""
    conn.execute("UPDATE runs SET preempted_by = NULL WHERE id = ? AND preempted_by IS NOT NULL", (run_id,))

