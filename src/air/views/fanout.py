"""Follow streams that scale: one reader per followed run, whose events fan out to every follower.

`air server`'s follow streams (the API's NDJSON, air.server.fanout; the pages' SSE, air.web.stream) used
to be a generator per follower, sleeping in the server's thread pool: 40 followers of one run took every
thread and `GET /runs/{id}` waited its turn. Here a follower is a bounded queue on the event loop. One
`Reader` per run (and per selection: node, rank, pinned attempt) polls the run and its logs once
(`air.views.follow.Following`, one short step in a worker thread every POLL_S), encodes each event once
(the hub's `encode`), and hands the same object to every follower's queue.

- A newcomer starts exactly where the reader is (`Following.join`): its tail (or its `--minutes`, or the
  attempt from its first line) up to the reader's position, then everything the reader reads. A
  follower that keeps up gets every line, in order, and the terminal event.
- A follower that reads too slowly is skipped ahead: when its queue is past its bounds, what was queued is
  dropped and the follower next takes a `Skipped` saying how many lines it missed, then the newest
  events. Nothing it does slows the reader, the other followers or the API.
- The run is sent when it changed (and every RUN_EVENT_EVERY_S), not at every poll: 300 followers of a
  quiet run cost the server almost nothing.
- The reader stops when its last follower leaves (or the run ends): no task or thread stays behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from anyio.to_thread import run_sync as run_in_threadpool

from air.errors import AirError
from air.store.run_store import Run as StoreRun
from air.store.run_store import RunStore
from air.views.follow import POLL_S, FollowEvent, Following, Lines

log = logging.getLogger(__name__)

#: What one follower may have queued before it is skipped ahead: events, and bytes (shared with the other
#: followers: the bytes are the reader's, a queue holds references).
QUEUE_EVENTS = 512
QUEUE_BYTES = 8 << 20

#: A run event goes to the followers when the run changed, and at least this often (seconds) otherwise.
RUN_EVENT_EVERY_S = 5.0

#: A reader's selection: run id, node, rank, pinned attempt.
Key = tuple[str, int | None, int | None, int | None]


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class Item:
    """One event the reader read, shared by every follower; encoded once (the hub's `encode`, in the
    reader's worker thread) where the followers send bytes. `event` None: an `error` that ends the stream."""

    __slots__ = ("encoded", "error", "event", "lines", "size")

    def __init__(self, event: FollowEvent | None, encode: Callable[[FollowEvent], bytes] | None = None,
                 error: AirError | None = None) -> None:
        self.event, self.error = event, error
        self.lines = len(event.lines) if isinstance(event, Lines) else 0
        self.encoded = encode(event) if encode is not None and event is not None else None
        self.size = (len(self.encoded) if self.encoded is not None
                     else sum(len(line) + 8 for line in event.lines) + 64 if isinstance(event, Lines) else 256)


@dataclass
class Skipped:
    """In what a follower takes: `count` lines were left out here (it fell behind)."""

    count: int


@dataclass
class Follower:
    """One follower's bounded queue of the reader's events. Filled by its reader, emptied by its stream."""

    max_events: int = QUEUE_EVENTS
    max_bytes: int = QUEUE_BYTES
    items: deque[Item] = field(default_factory=deque)
    size: int = 0
    #: Lines dropped since this follower last took its queue (it fell behind).
    skipped: int = 0
    ended: bool = False
    waiter: asyncio.Future[None] | None = None

    def put(self, item: Item) -> None:
        if self.ended:
            return
        size = item.size
        if self.items and (len(self.items) >= self.max_events or self.size + size > self.max_bytes):
            dropped = sum(queued.lines for queued in self.items)  # skip ahead: the newest events, and a marker
            self.skipped += dropped
            self.items.clear()
            self.size = 0
        self.items.append(item)
        self.size += size
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None:
            _wake(self.waiter)

    def end(self, last: Item | None = None) -> None:
        """No more events (after `last`, if given): the stream ends once it has sent what is queued."""
        if last is not None:
            self.put(last)
        self.ended = True
        self._wake()

    async def take_items(self, timeout: float) -> list[Item | Skipped] | None:
        """What is queued ([] when nothing came within `timeout`), a `Skipped` first where lines were left
        out; None once ended and all sent."""
        if not self.items and not self.ended:  # a bare future and a timer: no task per wait
            loop = asyncio.get_running_loop()
            self.waiter = waiter = loop.create_future()
            timer = loop.call_later(timeout, _wake, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self.waiter = None
        if not self.items:
            return None if self.ended else []
        taken: list[Item | Skipped] = [Skipped(self.skipped)] if self.skipped else []
        taken += self.items
        self.skipped = 0
        self.items.clear()
        self.size = 0
        return taken


@dataclass
class _Join:
    follower: Follower
    tail: int | None
    since: float | None
    offset: int | None = None


def _error(exc: AirError) -> Item:
    return Item(None, error=exc)


class Reader:
    """One run's follow (one selection of its logs), fanned out to its followers; an asyncio task that
    lives while someone follows."""

    def __init__(self, hub: FollowHub, key: Key, following: Following) -> None:
        self.hub, self.key, self.following = hub, key, following
        self.followers: list[Follower] = []
        self.joining: list[_Join] = []
        self.wake = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self._sent_run: StoreRun | None = None
        self._sent_at = 0.0

    def _poll(self, joins: list[_Join]) -> list[tuple[list[Item], _Join | None]]:
        """In a worker thread: one step, then the newcomers' starts, each event encoded once, here. What
        to hand out, in order: events for everyone already there (None), or a newcomer's first events
        (then it is there too)."""

        def items(events: Sequence[FollowEvent]) -> list[Item]:
            return [Item(event, self.hub.encode) for event in events]

        events = self.following.step()
        now = time.monotonic()
        run = self.following.run
        if run == self._sent_run and now - self._sent_at < RUN_EVENT_EVERY_S and not self.following.done:
            events = [e for e in events if not isinstance(e, StoreRun)]  # unchanged: not sent again to everyone
        else:
            self._sent_run, self._sent_at = run, now
        out: list[tuple[list[Item], _Join | None]] = [(items(events), None)]
        for join in joins:
            ours, theirs = self.following.join(tail=join.tail, since=join.since, offset=join.offset)
            out.append((items(ours), None))
            first: list[FollowEvent] = [*theirs, *([run] if run is not None else [])]
            out.append((items(first), join))
        return out

    async def run(self) -> None:
        joins: list[_Join] = []
        loop = asyncio.get_running_loop()
        try:
            while True:
                polled_at = loop.time()
                joins, self.joining = self.joining, []
                for items, join in await run_in_threadpool(self._poll, joins):
                    if join is not None:
                        if join.follower.ended:  # it left while we read
                            continue
                        self.followers.append(join.follower)
                    for item in items:
                        for follower in [join.follower] if join is not None else self.followers:
                            follower.put(item)
                joins = []
                if self.following.done:
                    for follower in self.followers:
                        follower.end()
                    return
                if not self.followers and not self.joining:
                    return
                self.wake.clear()
                if not self.following.behind:  # a step reads a bounded block of each log: read on at once
                    # Steps on a fixed cadence: the step and its hops to a worker thread and back (slow on a
                    # loaded machine) are not added to the wait; a quarter poll is always left to batch in.
                    wait = max(self.hub.poll_s / 4, self.hub.poll_s - (loop.time() - polled_at))
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.wake.wait(), wait)
        except AirError as exc:  # the run went away (pruned) or its logs cannot be read: say so, end
            for follower in [*self.followers, *(j.follower for j in [*joins, *self.joining])]:
                follower.end(_error(exc))
            self.joining = []
        except Exception as exc:
            log.exception("following run %s failed", self.key[0])
            for follower in [*self.followers, *(j.follower for j in [*joins, *self.joining])]:
                follower.end(_error(AirError(f"Following run {self.key[0]} failed on the server: {exc}")))
            self.joining = []
        except asyncio.CancelledError:  # the server's loop is closing: every stream ends with it
            for follower in [*self.followers, *(j.follower for j in [*joins, *self.joining])]:
                follower.end()
            self.joining = []
            raise
        finally:
            self.hub.readers.pop(self.key, None)  # before any await: a newcomer from now on gets a new reader
            for join in self.joining:  # came while the run ended: a reader of its own tells it so
                self.hub.rejoin(self.key, self.following, join)
            self.joining = []


class FollowHub:
    """The server's readers, one per followed (run, selection); lives on the app (`hub_of`)."""

    def __init__(self, poll_s: float = POLL_S, encode: Callable[[FollowEvent], bytes] | None = None) -> None:
        self.poll_s, self.encode = poll_s, encode
        self.readers: dict[Key, Reader] = {}
        self._checks: dict[Hashable, tuple[float, asyncio.Future[bytes | None]]] = {}

    def follow(self, key: Key, make: Callable[[], Following], *, tail: int | None, since: float | None,
               offset: int | None = None, max_events: int = QUEUE_EVENTS, max_bytes: int = QUEUE_BYTES) -> Follower:
        """A new follower of `key`'s reader (started with `make()` if there is none); its first events come
        once the reader has placed it (at its next poll, which this hastens)."""
        follower = Follower(max_events=max_events, max_bytes=max_bytes)
        self._join(key, make, _Join(follower, tail, since, offset))
        return follower

    def _join(self, key: Key, make: Callable[[], Following], join: _Join) -> None:
        reader = self.readers.get(key)
        if reader is None:
            reader = self.readers[key] = Reader(self, key, make())
            reader.task = asyncio.get_running_loop().create_task(reader.run(), name=f"air-follow-{key[0]}")
        reader.joining.append(join)
        reader.wake.set()

    def rejoin(self, key: Key, ended: Following, join: _Join) -> None:
        template = ended
        self._join(key, lambda: Following(template.run_id, store=template.store, node=template.node,
                                          rank=template.rank, attempt=template.attempt, mask=template.mask,
                                          from_end=True), join)

    async def recheck(self, key: Hashable, check: Callable[[], bytes | None], max_age: float) -> bytes | None:
        """`check()` (in a worker thread) for every follower with the same `key` (their token and run) at
        most once per `max_age` seconds: 300 followers with one token ask the store once, not 300 times.
        None: still allowed; else the stream's last line."""
        now = time.monotonic()
        cached = self._checks.get(key)
        if cached is None or now - cached[0] >= max_age:
            if len(self._checks) > 1024:
                self._checks = {k: v for k, v in self._checks.items() if now - v[0] < max_age}
            cached = self._checks[key] = (now, asyncio.ensure_future(run_in_threadpool(check)))
        try:
            return await asyncio.shield(cached[1])
        except Exception:
            self._checks.pop(key, None)
            raise

    def leave(self, follower: Follower) -> None:
        """A follower went away: its reader stops at its next poll if it was the last."""
        follower.ended = True
        for reader in list(self.readers.values()):
            if follower in reader.followers:
                reader.followers.remove(follower)
                if not reader.followers:
                    reader.wake.set()

    def tasks(self) -> list[asyncio.Task[None]]:
        """The readers' tasks now (tests: none is left once every follower has gone)."""
        return [r.task for r in self.readers.values() if r.task is not None]


def hub_of(app: Any, encode: Callable[[FollowEvent], bytes] | None = None) -> FollowHub:
    """The app's hub (made on first use, on the event loop; its followers send `encode`d events)."""
    hub = getattr(app.state, "follow_hub", None)
    if hub is None:
        hub = app.state.follow_hub = FollowHub(encode=encode)
    return hub


def reader_following(run_id: str, store: RunStore, *, node: int | None, rank: int | None, attempt: int | None,
                     mask: Callable[[str], str]) -> Callable[[], Following]:
    """How a reader of this selection follows the run: from where the logs are when it starts."""
    return lambda: Following(run_id, store=store, node=node, rank=rank, attempt=attempt, mask=mask, from_end=True)

