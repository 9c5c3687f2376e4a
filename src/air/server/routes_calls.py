"""`/api/v1/calls`: `@distributed(remote=True)` calls the server drives (air.distributed.call_driver),
and `/api/v1/runs/{id}/result`, every rank's value (pickled) once the call ended: its owner's only."""

from __future__ import annotations

import base64
import binascii
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from air.constants import SERVER_MAX_UPLOAD_BYTES
from air.errors import UserInputError
from air.runs.paths import CallPaths
from air.server.app import AuthError, Caller, store_of
from air.server.routes_runs import json_body

router = APIRouter()


class NotReady(UserInputError):
    code = "NOT_READY"
    http_status = 409


@router.post("/calls")
async def submit_call(request: Request, who: Caller) -> dict[str, Any]:
    from air.distributed.call_driver import start_call

    body = await json_body(request, SERVER_MAX_UPLOAD_BYTES)  # the pickled call travels inside it
    if not isinstance(body, dict):
        raise UserInputError("The call must be a JSON object.")
    try:
        payload = base64.b64decode(str(body.get("payload_b64", "")), validate=True)
        name, count, kind = str(body.get("name") or "fn")[:200], int(body["num_accelerators"]), str(body["accelerator_type"])
        timeout = None if body.get("timeout") is None else float(body["timeout"])
        hang_timeout = None if body.get("hang_timeout") is None else float(body["hang_timeout"])
        retries = int(body.get("max_retries") or 0)
        preload = [str(m) for m in body.get("preload") or []]
        use_reserved = body.get("use_reserved_pool")
        if use_reserved is not None and not isinstance(use_reserved, bool):
            raise TypeError("use_reserved_pool must be true, false or null")
        pool = body.get("pool")
        if pool is not None and not isinstance(pool, str):
            raise TypeError("pool must be a pool's name or null")
    except (KeyError, TypeError, ValueError, binascii.Error) as exc:
        raise UserInputError(f"Malformed call: {type(exc).__name__}: {exc}",
                             hint="Send payload_b64, name, num_accelerators, accelerator_type[, timeout, "
                             "hang_timeout, max_retries, preload, use_reserved_pool, pool].") from None
    if not payload or count <= 0 or not 0 <= retries <= 100 or (hang_timeout is not None and hang_timeout <= 0):
        raise UserInputError("A call needs a payload, num_accelerators > 0, max_retries 0 to 100 and a "
                             "hang_timeout above 0 when given.")
    run = await run_in_threadpool(
        start_call, store_of(request), user=who.user, payload=payload, name=name, num_accelerators=count,
        accelerator_type=kind, timeout=timeout, hang_timeout=hang_timeout, max_retries=retries, preload=preload,
        experiment=str(body.get("experiment") or "air-distributed")[:200], use_reserved=use_reserved,
        pool_asked=pool)
    return {"run_id": run.id, "num_nodes": run.num_nodes, "world": run.num_accelerators, "status": run.status.value}


@router.get("/runs/{run_id}/result")
def call_result(request: Request, run_id: str, who: Caller) -> Response:
    from air.server.visibility import readable_run

    run = readable_run(store_of(request), run_id, who)  # one who may not view it: 404
    if run.user != who.user and not who.admin:
        raise AuthError(f"Run {run.id} belongs to {run.user}; only its owner may fetch its result.", status=403)
    if run.kind != "call":
        raise UserInputError(f"Run {run.id} is a workload; only @distributed calls have a result.")
    result = CallPaths(run.id).result
    if not result.exists():
        raise NotReady(f"Call {run.id} has no result yet ({run.status.value}).")
    return Response(result.read_bytes(), media_type="application/octet-stream")
