"""A sweep's tasks (table `sweep_tasks`, owned here): the item each child run carries out, and the parent and
child of each. Cancel and the read side (air.views) need them without the parent's supervisor (sweep.py)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from air.errors import NotFoundError
from air.store.paths import RunPaths
from air.store.run_store import Run, RunStore
from air.workload.plan import RunPlan

_TOP_LEVEL_FOR_EACH = re.compile(r"^for_each:", re.MULTILINE)


def is_sweep_spec(spec_yaml: str) -> bool:
    """Whether a stored spec (yaml.safe_dump of the resolved spec) is a sweep: a top-level `for_each:`
    (only top-level keys start a line unindented)."""
    return bool(_TOP_LEVEL_FOR_EACH.search(spec_yaml or ""))


@dataclass(frozen=True)
class SweepTask:
    """One item of a sweep and the child run carrying it out (None until submitted)."""

    index: int
    item: dict[str, object]
    child_run_id: str | None


def record_tasks(store: RunStore, parent_run_id: str, items: list[dict[str, object]]) -> None:
    """The parent's tasks, once (a second call keeps what is there)."""
    with store.writer() as conn:
        conn.executemany(
            "INSERT OR IGNORE INTO sweep_tasks (parent_run_id, task_index, child_run_id, item) VALUES (?, ?, NULL, ?)",
            [(parent_run_id, i, json.dumps(item, default=str)) for i, item in enumerate(items)])


def list_tasks(store: RunStore, parent_run_id: str) -> list[SweepTask]:
    rows = store.reader().execute(
        "SELECT task_index, item, child_run_id FROM sweep_tasks WHERE parent_run_id = ? ORDER BY task_index",
        (parent_run_id,)).fetchall()
    return [SweepTask(index, json.loads(item), child) for index, item, child in rows]


def set_child(store: RunStore, parent_run_id: str, index: int, child_run_id: str) -> None:
    with store.writer() as conn:
        conn.execute("UPDATE sweep_tasks SET child_run_id = ? WHERE parent_run_id = ? AND task_index = ?",
                     (child_run_id, parent_run_id, index))


def parent_of(store: RunStore, child_run_id: str) -> tuple[str, int] | None:
    """(parent run id, task index) of a sweep's child; None for any other run."""
    row = store.reader().execute("SELECT parent_run_id, task_index FROM sweep_tasks WHERE child_run_id = ?",
                                 (child_run_id,)).fetchone()
    return (str(row[0]), int(row[1])) if row else None


def child_run_ids(store: RunStore, parent_run_id: str) -> list[str]:
    return [t.child_run_id for t in list_tasks(store, parent_run_id) if t.child_run_id]


def max_concurrent_of(run_id: str) -> int | None:
    """A sweep's `max_concurrent` as its plan has it (None: unset, or not a sweep)."""
    try:
        plan = RunPlan.from_json(RunPaths(run_id).submission.read_text())
    except (OSError, ValueError, TypeError):
        return None
    return plan.sweep.get("max_concurrent") if plan.sweep else None


def child_run(store: RunStore, run_id: str | None) -> Run | None:
    """A task's child run; None before it is submitted, or once pruned."""
    if run_id is None:
        return None
    try:
        return store.get_run(run_id)
    except NotFoundError:
        return None
