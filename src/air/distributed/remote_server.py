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
from air.distributed.local import serialize_call
from air.distributed.preload import preload_for
from air.distributed.shape import CallSettings
from air.errors import RuntimeConfigurationError, WorkloadFailureException

#: How often the client asks whether a call it lost the log stream of has ended (seconds).
_POLL_S = 0.5


def call_through_server(client: ServerClient, func: Callable[..., Any], args: Sequence[Any],
                        kwargs: Mapping[str, Any], settings: CallSettings, *, echo: bool = True,
                        max_retries: int = 0) -> list[Any]:
    if settings.num_accelerators is None or not settings.accelerator_type:
        raise RuntimeConfigurationError("remote=True needs num_accelerators and accelerator_type.",
                                        hint="For example @distributed(num_accelerators=2, accelerator_type='CPU', "
                                        "remote=True).")
    from air.config import remote_pool_id, use_reserved_pool

    payload = serialize_call(func, args, kwargs)
    answer = client.post("/calls", {
        "payload_b64": base64.b64encode(payload).decode(), "name": getattr(func, "__name__", "fn"),
        "num_accelerators": settings.num_accelerators, "accelerator_type": settings.accelerator_type,
        "timeout": settings.timeout, "hang_timeout": settings.hang_timeout, "max_retries": max_retries,
        "preload": list(preload_for(func, args, kwargs)),
        "experiment": os.environ.get("MLFLOW_EXPERIMENT_NAME") or "air-distributed",
        "use_reserved_pool": use_reserved_pool(), "pool": remote_pool_id()})
    run_id = answer["run_id"]
    if echo:
        sys.stderr.write(f"[air] run {run_id}: {answer['world']} rank(s) on {answer['num_nodes']} node(s), "
                         f"driven by {client.url}\n")
    try:
        _stream(client, run_id, echo)
        while client.get(f"/runs/{run_id}")["status"] not in _TERMINAL:
            time.sleep(_POLL_S)
        data = _result(client, run_id)
    except KeyboardInterrupt:
        client.post(f"/runs/{run_id}/cancel")
        raise
    kind, value = cloudpickle.loads(data)
    if kind == "ok":
        return list(value)
    raise value if isinstance(value, BaseException) else WorkloadFailureException(str(value))


_TERMINAL = {"SUCCESS", "FAILED", "TIMEDOUT", "CANCELED", "INTERNAL_ERROR"}


def _stream(client: ServerClient, run_id: str, echo: bool) -> None:
    """Every rank's lines, `[rank r]`-prefixed, until the run ends (or the stream breaks)."""
    for item in client.stream(f"/runs/{run_id}/follow"):
        if echo and "lines" in item:
            for line in item["lines"]:
                sys.stdout.write(f"[{item['label']} {item['index']}] {line}\n")
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
