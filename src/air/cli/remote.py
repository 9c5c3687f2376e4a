"""The CLI's side of `air server`: which commands go there, submitting a workload (the SDK's
`submit_to_server`: spec + code snapshot, uploading only the blobs the server lacks), and turning the
server's typed follow events (air.client.models) back into the events the local commands print.
Printing itself is shared with the local commands (one printing path)."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import Any

from air.client import ServerClient, server_client
from air.client.models import Event, LinesEvent, NewAttemptEvent, RunEvent, SkippedEvent
from air.errors import UserInputError
from air.runs.follow import FollowEvent, Lines, LogSource, NewAttempt
from air.runs.views import run_from_dict


def remote() -> ServerClient | None:
    """The server this command goes to (AIR_SERVER_URL + AIR_TOKEN, or a `server` profile), or None."""
    from air.cli.main import settings

    return server_client(settings().profile)


def submit_remote(client: ServerClient, path: str, overrides: list[str], *, idempotency_key: str | None,
                  dry_run: bool, watch_node: int | None = None) -> dict[str, Any]:
    """Validate the workload here (same errors as locally), then submit it to the server; the answer
    (air.client.models.SubmitAnswer or DryRunAnswer) as a dict."""
    from air.client.sdk import submit_to_server
    from air.workload.loading import load_workload

    spec = load_workload(path, overrides)
    if watch_node is not None and watch_node >= spec.num_nodes:
        raise UserInputError(f"--node {watch_node}: the workload has {spec.num_nodes} node(s).",
                             hint=f"Nodes are numbered 0 to {spec.num_nodes - 1}.")
    return submit_to_server(client, spec, idempotency_key=idempotency_key, dry_run=dry_run).model_dump(mode="json")


def follow_events(events: Iterable[Event]) -> Iterator[FollowEvent]:
    """The server's typed follow events as the events `air.runs.follow.follow` yields here."""
    for item in events:
        if isinstance(item, RunEvent):
            yield run_from_dict(item.run.model_dump(mode="json"))
        elif isinstance(item, LinesEvent):
            yield Lines(LogSource(item.label, item.index), item.lines, item.attempt)
        elif isinstance(item, NewAttemptEvent):
            yield NewAttempt(item.new_attempt, item.previous)
        elif isinstance(item, SkippedEvent):  # this follower fell behind the run's output: said, not silent
            sys.stderr.write(f"air: {item.skipped} line(s) skipped: this follower read more slowly than the run "
                             "wrote (air logs ID shows them).\n")


def follow_remote(client: ServerClient, run_id: str, **params: object) -> Iterator[FollowEvent]:
    """A followed run through the server. A stream that ends before the run does (the server stopped)
    is an error that says how to reattach."""
    from air.client import RemoteError

    last = None
    for item in follow_events(client.events(run_id, **params)):
        if not isinstance(item, Lines | NewAttempt):
            last = item
        yield item
    pinned = params.get("attempt") is not None
    if params.get("live", True) and not pinned and (last is None or not last.is_terminal):
        raise RemoteError(f"The air server at {client.url} stopped streaming run {run_id} before it ended.",
                          code="UNAVAILABLE", kind="TRANSIENT",
                          hint=f"The run goes on there; reattach with: air logs {run_id} --follow")
