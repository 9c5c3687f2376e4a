"""`/api/v1/calls`: `@distributed(remote=True)` calls the server drives (air.distributed.call_driver),
and `/api/v1/runs/{id}/result`, every rank's value (pickled) once the call ended: its owner's only.

The server never unpickles either: the call's payload is unpickled by its ranks, in the caller's
sandbox; the result is a typed header and the ranks' pickled bytes (air.distributed.outcome.CallResult),
sent on as the call driver wrote it, for the caller alone to unpickle."""

from __future__ import annotations

import base64
import binascii

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, Response
from starlette.concurrency import run_in_threadpool

from air.constants import SERVER_MAX_UPLOAD_BYTES
from air.errors import UserInputError
from air.server.deps import AuthError, Caller, json_body, parse_request, store_of
from air.store.paths import CallPaths
from air.wire import CallAnswer, CallRequest

router = APIRouter()


class NotReady(UserInputError):
    code = "NOT_READY"
    http_status = 409


@router.post("/calls")
async def submit_call(request: Request, who: Caller) -> CallAnswer:
    from air.distributed.call_driver import start_call

    body = await json_body(request, SERVER_MAX_UPLOAD_BYTES)  # the pickled call travels inside it
    call = parse_request(CallRequest, body, "call")
    try:
        payload = base64.b64decode(call.payload_b64, validate=True)
    except (ValueError, binascii.Error) as exc:
        raise UserInputError(f"Malformed call: payload_b64 is not base64 ({exc}).",
                             hint="Send the cloudpickled call, base64-encoded.") from None
    if not payload:
        raise UserInputError("Malformed call: payload_b64 is empty.", hint="Send the cloudpickled call, base64-encoded.")
    run = await run_in_threadpool(start_call, store_of(request), who.user, call, payload)
    return CallAnswer(run_id=run.id, num_nodes=run.num_nodes, world=run.num_accelerators, status=run.status)


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
    return FileResponse(result, media_type="application/octet-stream")  # streamed as written, never parsed
