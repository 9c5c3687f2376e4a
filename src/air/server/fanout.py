"""The API's follow streams on the shared readers of air.views.fanout: each event encoded once as the
NDJSON line of `GET /runs/{id}/follow` (air.wire), a follower that fell behind told so with a
`SkippedEvent`, a reader's failure as the stream's last `ErrorEvent` line."""

from __future__ import annotations

from starlette.applications import Starlette

from air.server.deps import error_body
from air.store.run_store import RunStore
from air.views.fanout import Follower, FollowHub, Item, Skipped
from air.views.follow import FollowEvent
from air.views.query import event_from
from air.wire import SkippedEvent, encode_event


def ndjson_line(event: FollowEvent, store: RunStore | None = None) -> bytes:
    """An event as its NDJSON line (with `store`, a QUEUED run's says why it waits: `event_from`)."""
    return encode_event(event_from(event, store))


def hub_of(app: Starlette) -> FollowHub:
    """The API app's hub: its readers encode NDJSON lines."""
    from air.views.fanout import hub_of as _hub_of

    store = app.state.store
    return _hub_of(app, encode=lambda event: ndjson_line(event, store))


def _line(item: Item | Skipped) -> bytes:
    if isinstance(item, Skipped):
        return encode_event(SkippedEvent(skipped=item.count))
    if item.error is not None:
        return encode_event(error_body(item.error))
    if item.encoded is not None:
        return item.encoded
    assert item.event is not None
    return ndjson_line(item.event)


async def take_ndjson(follower: Follower, timeout: float) -> bytes | None:
    """What the follower has queued, as NDJSON lines in one chunk (b"" when nothing came within `timeout`);
    None once its stream has ended and all was sent."""
    taken = await follower.take_items(timeout)
    return None if taken is None else b"".join(_line(item) for item in taken)

