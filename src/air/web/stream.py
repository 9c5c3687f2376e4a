"""Live log lines as Server-Sent Events: follow one node's (or rank's) log from an offset until the run
ends, then say so. Reads only what was appended (`LineCursor`), never the file from the start."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from air.constants import STREAM_AUTH_RECHECK_S, WEB_STREAM_POLL_S
from air.runs.logtail import LineCursor
from air.runs.store import RunStore
from air.runs.views import LOG_TAIL_LINES, marked_line

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
    path: Path,
    offset: int | None,
    mask: Callable[[str], str],
    *,
    attempt: int | None,
    signed_in: Callable[[], bool] | None = None,
) -> AsyncIterator[str]:
    """Events `lines` (a JSON list of marked lines) as the log grows, and `end` (the run's status) once
    the run is over (or moved on to another attempt) and the log is drained. From `offset` (where the
    page's lines ended), or without one from the last LOG_TAIL_LINES lines: never the whole file.
    `signed_in` is asked again every STREAM_AUTH_RECHECK_S: a revoked token's stream ends there with
    `signed_out` (the page reloads into the login page)."""
    cursor = LineCursor(path)
    yield ": following\n\n"  # flushes the headers: the browser's EventSource opens now
    if offset is None:
        first = cursor.start_at_tail(LOG_TAIL_LINES)
        if first:
            yield _event("lines", [marked_line(None, mask(t)) for t in first], cursor.offset)
    else:
        cursor.offset = max(0, offset)
    stopping = getattr(request.app.state, "stopping", None)  # set by `air server` as it stops
    checked = time.monotonic()
    while True:
        if await request.is_disconnected() or (stopping is not None and stopping.is_set()):
            return  # a browser reconnects (Last-Event-ID) and goes on where this ended
        if signed_in is not None and time.monotonic() - checked >= STREAM_AUTH_RECHECK_S:
            if not await run_in_threadpool(signed_in):
                yield _event("signed_out", {})  # the page reloads: the login page now
                return
            checked = time.monotonic()
        run = store.get_run(run_id)
        over = run.is_terminal or (attempt is not None and run.current_attempt not in (None, attempt))
        lines = cursor.read(final=over)
        resume_at = cursor.offset - len(cursor.pending)
        for start in range(0, len(lines), LINES_PER_EVENT):
            batch = [marked_line(None, mask(t)) for t in lines[start:start + LINES_PER_EVENT]]
            last = start + LINES_PER_EVENT >= len(lines)
            yield _event("lines", batch, resume_at if last else None)
        if over:
            yield _event("end", {"status": run.status.value, "reason": run.termination_reason})
            return
        await asyncio.sleep(WEB_STREAM_POLL_S)


__all__ = ["follow_log"]
