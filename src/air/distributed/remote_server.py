"""`@distributed(remote=True)` through an `air server`: the call is sent (pickled, with its shape), the
server drives it as a run of kind `call` (air.distributed.call_driver), and this process streams its
rank logs and fetches every rank's value, or the rank's exception, when it ends. Ctrl-C cancels it."""

from __future__ import annotations

import base64
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import cloudpickle

from air.client import RemoteError, ServerClient
from air.client.models import CallAnswer, CallRequest, LinesEvent, Run, RunEvent
from air.distributed.local import serialize_call
from air.distributed.preload import preload_for
from air.distributed.shape import CallSettings
from air.errors import RuntimeConfigurationError, WorkloadFailureException
from air.runs.states import RunStatus

#: How often the client asks whether a call it lost the log stream of has ended (seconds).
_POLL_S = 0.5
#: While the call is QUEUED: how often the client asks the server why (seconds), and the least time
#: between two lines saying why (a new line only when the reason changed).
_QUEUE_LOOK_S = 1.0
_QUEUE_LINE_EVERY_S = 10.0


def call_through_server(client: ServerClient, func: Callable[..., object], args: Sequence[object],
                        kwargs: Mapping[str, object], settings: CallSettings, *, echo: bool = True,
                        max_retries: int = 0) -> list[Any]:
    if settings.num_accelerators is None or not settings.accelerator_type:
        raise RuntimeConfigurationError("remote=True needs num_accelerators and accelerator_type.",
                                        hint="For example @distributed(num_accelerators=2, accelerator_type='CPU', "
                                        "remote=True).")
    from air.config import remote_pool_id, use_reserved_pool

    payload = serialize_call(func, args, kwargs)
    request = CallRequest(
        payload_b64=base64.b64encode(payload).decode(), name=str(getattr(func, "__name__", "fn"))[:200],
        num_accelerators=settings.num_accelerators, accelerator_type=settings.accelerator_type,
        timeout=settings.timeout, hang_timeout=settings.hang_timeout, max_retries=max_retries,
        preload=list(preload_for(func, args, kwargs)),
        experiment=os.environ.get("MLFLOW_EXPERIMENT_NAME") or "air-distributed",
        use_reserved_pool=use_reserved_pool(), pool=remote_pool_id())
    answer = CallAnswer.model_validate(client.post("/calls", request.model_dump(mode="json")))
    run_id = answer.run_id
    if echo:
        sys.stderr.write(f"[air] run {run_id}: {answer.world} rank(s) on {answer.num_nodes} node(s), "
                         f"driven by {client.url}\n")
    try:
        _stream(client, run_id, echo)
        while not Run.model_validate(client.get(f"/runs/{run_id}")).is_terminal:
            time.sleep(_POLL_S)
        data = _result(client, run_id)
    except KeyboardInterrupt:
        client.post(f"/runs/{run_id}/cancel")
        raise
    kind, value = cloudpickle.loads(data)
    if kind == "ok":
        return list(value)
    raise value if isinstance(value, BaseException) else WorkloadFailureException(str(value))


class _QueueSayer:
    """"[air] run X is queued: <why>" on stderr while the call waits in the server's queue (position,
    pool, per-user limit: the `queue` of `GET /runs/{id}`), as `air run --watch` says it; a new line only
    when the reason changed, and at most every _QUEUE_LINE_EVERY_S."""

    def __init__(self, client: ServerClient, run_id: str) -> None:
        self.client, self.run_id = client, run_id
        self.next_look = 0.0
        self.last_line_at: float | None = None
        self.said: str | None = None

    def see(self, status: RunStatus) -> None:
        now = time.monotonic()
        if status is not RunStatus.QUEUED or now < self.next_look:
            return
        self.next_look = now + _QUEUE_LOOK_S
        if self.last_line_at is not None and now - self.last_line_at < _QUEUE_LINE_EVERY_S:
            return
        try:
            queue = Run.model_validate(self.client.get(f"/runs/{self.run_id}")).queue or {}
        except RemoteError:
            return  # a failed look says nothing; the stream goes on
        reason = queue.get("reason")
        if not reason or reason == self.said:
            return
        sys.stderr.write(f"[air] run {self.run_id} is queued: {reason}\n")
        sys.stderr.flush()
        self.said, self.last_line_at = str(reason), now


def _stream(client: ServerClient, run_id: str, echo: bool) -> None:
    """Every rank's lines, `[rank r]`-prefixed, until the run ends (or the stream breaks); while the
    call is queued, why it waits."""
    queue = _QueueSayer(client, run_id)
    for item in client.events(run_id):
        if echo and isinstance(item, RunEvent):
            queue.see(item.run.status)
        if echo and isinstance(item, LinesEvent):
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
