"""Live log lines as Server-Sent Events: follow one node's (or rank's) log from an offset until the run
ends, then say so. Reads only what was appended, never the file from the start, through the one reader
all followers of that log share (air.views.fanout)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from air.constants import STREAM_AUTH_RECHECK_S, WEB_STREAM_POLL_S
from air.store.run_store import Run, RunStore
from air.views.fanout import Skipped, hub_of, reader_following
from air.views.follow import Lines
from air.views.query import LOG_TAIL_LINES, marked_line

#: Lines sent per event at most (a burst of output is several events, not one huge one).
LINES_PER_EVENT = 500


def _event(name: str, data: object, event_id: int | None = None) -> str:
    """One SSE event; `event_id` (the byte offset after its lines) is what a reconnecting browser sends
    back as Last-Event-ID, so it resumes there instead of repeating lines."""
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {name}\ndata: {json.dumps(data)}\n\n"


async def follow_log(
    request: Request,
    store: RunStore,
    run_id: str,
    label: str,
    index: int,
    offset: int | None,
    mask: Callable[[str], str],
    *,
    attempt: int | None,
    signed_in: Callable[[], bool] | None = None,
) -> AsyncIterator[str]:
    """Events `lines` (a JSON list of marked lines) as the log of `label` ("node" or "rank") `index` grows, and `end`
    (the run's status) once the run is over (or moved on to another attempt) and the log is drained. From
    `offset` (where the page's lines ended), or without one from the last LOG_TAIL_LINES lines: never the
    whole file. `signed_in` is asked again every STREAM_AUTH_RECHECK_S: a revoked token's stream ends
    there with `signed_out` (the page reloads into the login page).

    Every page following this log shares one reader (air.views.fanout): it reads the file once per poll
    for all of them. A page that falls behind gets a line saying how many lines it skipped."""

    yield ": following\n\n"  # flushes the headers: the browser's EventSource opens now
    node, rank = (index, None) if label == "node" else (None, index)
    hub = hub_of(request.app)
    follower = hub.follow((run_id, node, rank, attempt),
                          reader_following(run_id, store, node=node, rank=rank, attempt=attempt, mask=mask),
                          tail=LOG_TAIL_LINES if offset is None else None, since=None,
                          offset=None if offset is None else max(0, offset))
    stopping = getattr(request.app.state, "stopping", None)  # set by `air server` as it stops
    checked = time.monotonic()
    last: Run | None = None
    try:
        while True:
            taken = await follower.take_items(timeout=WEB_STREAM_POLL_S)
            if await request.is_disconnected() or (stopping is not None and stopping.is_set()):
                return  # a browser reconnects (Last-Event-ID) and goes on where this ended
            if signed_in is not None and time.monotonic() - checked >= STREAM_AUTH_RECHECK_S:
                if not await run_in_threadpool(signed_in):
                    yield _event("signed_out", {})  # the page reloads: the login page now
                    return
                checked = time.monotonic()
            if taken is None:
                if last is not None:
                    yield _event("end", {"status": last.status.value, "reason": last.termination_reason})
                return
            for item in taken:
                if isinstance(item, Skipped):
                    note = f"[air] {item.count} line(s) skipped here: this page fell behind the log."
                    yield _event("lines", [marked_line(None, note)])
                elif isinstance(item.event, Run):
                    last = item.event
                elif isinstance(item.event, Lines):
                    lines, resume_at = item.event.lines, item.event.resume_at
                    for start in range(0, len(lines), LINES_PER_EVENT):
                        batch = [marked_line(None, t) for t in lines[start:start + LINES_PER_EVENT]]
                        final = start + LINES_PER_EVENT >= len(lines)
                        yield _event("lines", batch, resume_at if final else None)
                elif item.error is not None:  # the reader failed (the run went away): the page reconnects
                    return
    finally:
        hub.leave(follower)

