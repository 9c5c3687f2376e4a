"""Following a `for_each` sweep: its parent's events and each child's, merged into one stream, so that
`air run --watch` and `air subscribe` show what the sweep's tasks do (their states, their lines) and not
only the parent's.

The parent's follow stream and each child's (`air.Client.follow`: on this machine, or through `air server`
alike) are read by a thread each into one queue; the caller reads the queue, so a child that prints much
never holds up the parent's state or another child. Children are found as the sweep submits them (the
parent's `sweep.tasks`, read again every `DISCOVER_EVERY_S` while it runs); a child's ended state comes after
its last lines, the parent's after its children's. The merged stream ends once the parent's stream ended
and every child's has (a sweep ends after its children), or `CHILD_END_WAIT_S` later.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from air.wire import LinesEvent, NewAttemptEvent, RunEvent, SkippedEvent

if TYPE_CHECKING:
    from air.client.sdk import Client

#: What a follow stream yields.
Event = RunEvent | LinesEvent | NewAttemptEvent | SkippedEvent
#: A follow stream of one run: (run id, node) -> its events.
FollowFn = Callable[[str, "int | None"], Iterable[Event]]
#: Seconds between two looks at the parent for children it submitted since.
DISCOVER_EVERY_S = 1.0
#: Seconds the merged stream waits, once the parent's ended, for its children's streams to end.
CHILD_END_WAIT_S = 300.0


@dataclass(frozen=True)
class Child:
    """A sweep's task and the run that carries it out."""

    run_id: str
    index: int


class _End:
    """A stream's end (with the error that ended it, if one did)."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error


def sweep_children(client: Client, run_id: str) -> list[Child]:
    """The children the sweep `run_id` has submitted so far, in task order."""
    run = client.get(run_id)
    tasks = (run.sweep or {}).get("tasks") or []
    found = []
    for task in tasks if isinstance(tasks, list) else []:
        if isinstance(task, dict) and task.get("run_id"):
            found.append(Child(str(task["run_id"]), int(task.get("index") or 0)))
    return found


def follow_sweep(client: Client, run_id: str, *, node: int | None = None, follow: FollowFn | None = None,
                 on_child_error: Callable[[Child, BaseException], None] | None = None,
                 ) -> Iterator[tuple[Child | None, Event]]:
    """The sweep's events as (None, event) for the parent and (Child, event) for a child's, until the
    parent's stream and its children's ended. An error of the parent's stream is raised here; a child's
    ends that child's stream only (`on_child_error` hears of it)."""
    follow_fn: FollowFn = follow if follow is not None else (lambda rid, n: client.follow(rid, node=n))
    items: queue.Queue[tuple[Child | None, Event | _End]] = queue.Queue(maxsize=10_000)
    stopping = threading.Event()

    def pump(child: Child | None, rid: str) -> None:
        try:
            for event in follow_fn(rid, node):
                if stopping.is_set():
                    return
                items.put((child, event))
        except BaseException as exc:  # handed to the reader, which decides
            items.put((child, _End(exc)))
        else:
            items.put((child, _End()))

    def start(child: Child | None, rid: str) -> None:
        threading.Thread(target=pump, args=(child, rid), name=f"air-follow-{rid}", daemon=True).start()

    followed: set[str] = set()
    open_children = 0

    def discover() -> None:
        nonlocal open_children
        try:
            found = sweep_children(client, run_id)
        except Exception:  # a server that restarts: the next look finds them
            return
        for child in found:
            if child.run_id not in followed:
                followed.add(child.run_id)
                open_children += 1
                start(child, child.run_id)

    #: A run's ended state, held until its stream ends (a follow yields it before the last lines); the
    #: parent's until its children's streams ended too.
    held: dict[str, RunEvent] = {}
    start(None, run_id)
    parent_open = True
    last_look = 0.0
    ended_at: float | None = None
    try:
        while parent_open or open_children:
            if parent_open and time.monotonic() - last_look >= DISCOVER_EVERY_S:
                discover()
                last_look = time.monotonic()
            if ended_at is not None and time.monotonic() - ended_at > CHILD_END_WAIT_S:
                break
            try:
                child, item = items.get(timeout=DISCOVER_EVERY_S)
            except queue.Empty:
                continue
            key = child.run_id if child is not None else run_id
            if isinstance(item, _End):
                if child is None:
                    parent_open = False
                    discover()  # the children submitted last, before the sweep ended
                    ended_at = time.monotonic()
                    if item.error is not None:
                        raise item.error
                    continue
                open_children -= 1
                if key in held:  # its end state after its last lines
                    yield child, held.pop(key)
                if item.error is not None and on_child_error is not None:
                    on_child_error(child, item.error)
                continue
            if isinstance(item, RunEvent) and item.run.is_terminal:
                held[key] = item
                continue
            yield child, item
        if run_id in held:  # the sweep's own end, after its children's
            yield None, held.pop(run_id)
    finally:
        stopping.set()

