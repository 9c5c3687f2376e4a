"""`@distributed(remote=True)` through an `air server`: the call is sent (pickled, with its shape), the
server drives it as a run of kind `call` (air.distributed.call_driver), and this process streams its
rank logs and fetches every rank's value, or the rank's exception, when it ends. Ctrl-C cancels it.

The server never unpickles them (it reads the typed header beside them): this process, the caller, is
the only one that does, and it trusts its own function."""

from __future__ import annotations

import base64
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from air.client import RemoteError, ServerClient
from air.distributed.outcome import CallResult
from air.distributed.preload import preload_for
from air.distributed.ranks import call_experiment, serialize_call
from air.distributed.shape import CallSettings, required_shape
from air.wire import CallAnswer, CallRequest, LinesEvent, Run, RunEvent

#: How often the client asks whether a call it lost the log stream of has ended (seconds).
_POLL_S = 0.5
#: While the call is QUEUED: the least time between two lines saying why (a new one only when it changed).
_QUEUE_LINE_EVERY_S = 10.0


def call_through_server(client: ServerClient, func: Callable[..., object], args: Sequence[object],
                        kwargs: Mapping[str, object], settings: CallSettings, *, max_retries: int = 0) -> list[Any]:
    from air.config import remote_pool_id, use_reserved_pool

    count, accelerator_type = required_shape(settings)

    payload = serialize_call(func, args, kwargs)
    request = CallRequest(
        payload_b64=base64.b64encode(payload).decode(), name=str(getattr(func, "__name__", "fn"))[:200],
        num_accelerators=count, accelerator_type=accelerator_type,
        timeout=settings.timeout, hang_timeout=settings.hang_timeout, max_retries=max_retries,
        preload=list(preload_for(func, args, kwargs)),
        experiment=call_experiment(),
        use_reserved_pool=use_reserved_pool(), pool=remote_pool_id())
    answer = CallAnswer.model_validate(client.post("/calls", request.model_dump(mode="json")))
    run_id = answer.run_id
    sys.stderr.write(f"[air] run {run_id}: {answer.world} rank(s) on {answer.num_nodes} node(s), driven by "
                     f"{client.url}\n")
    try:
        _stream(client, run_id)
        while not Run.model_validate(client.get(f"/runs/{run_id}")).is_terminal:
            time.sleep(_POLL_S)
        data = _result(client, run_id)
    except KeyboardInterrupt:
        client.post(f"/runs/{run_id}/cancel")
        raise
    return CallResult.from_bytes(data).load()


def _stream(client: ServerClient, run_id: str) -> None:
    """Every rank's lines, `[rank r]`-prefixed, until the run ends (or the stream breaks); while the call
    is queued, why it waits (the `queue` of its run's events), as `air run --watch` says it: a new line only
    when the reason changed, and at most every _QUEUE_LINE_EVERY_S."""
    said: str | None = None
    said_at: float | None = None
    for item in client.events(run_id):
        if isinstance(item, RunEvent):
            reason = (item.run.queue or {}).get("reason")
            if reason and reason != said and (said_at is None or time.monotonic() - said_at >= _QUEUE_LINE_EVERY_S):
                sys.stderr.write(f"[air] run {run_id} is queued: {reason}\n")
                sys.stderr.flush()
                said, said_at = str(reason), time.monotonic()
        if isinstance(item, LinesEvent):
            for line in item.lines:
                sys.stdout.write(f"[{item.label} {item.index}] {line}\n")
            sys.stdout.flush()


def _result(client: ServerClient, run_id: str) -> bytes:
    deadline = time.monotonic() + 60  # the driver writes the result just after the run's last state
    while True:
        try:
            return client.get_bytes(f"/runs/{run_id}/result")
        except RemoteError as exc:
            if exc.http_status != 409 or time.monotonic() > deadline:
                raise
            time.sleep(_POLL_S)
