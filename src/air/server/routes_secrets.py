"""`/api/v1/secrets`: each user's own secret store on the server. Values go in, never out."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from air.errors import UserInputError
from air.server.app import Caller
from air.server.routes_runs import json_body
from air.server.tokens import Principal

router = APIRouter()


def _store(request: Request, who: Principal) -> Any:
    return request.app.state.paths.user_secrets(who.user)


@router.get("/secrets")
def list_secrets(request: Request, who: Caller) -> dict[str, Any]:
    from air.workload.secrets import list_secrets as listed

    return {"secrets": [{"scope": s, "key": k} for s, k in listed(store=_store(request, who))]}


@router.put("/secrets/{scope}/{key}")
async def put_secret(request: Request, scope: str, key: str, who: Caller) -> dict[str, Any]:
    from starlette.concurrency import run_in_threadpool

    from air.workload.secrets import put_secret as put

    body = await json_body(request)
    if not isinstance(body, dict) or not isinstance(body.get("value"), str):
        raise UserInputError("The body must be {\"value\": \"...\"}.")
    await run_in_threadpool(put, scope, key, body["value"], store=_store(request, who))
    return {"scope": scope, "key": key}


@router.delete("/secrets/{scope}/{key}")
def delete_secret(request: Request, scope: str, key: str, who: Caller) -> dict[str, Any]:
    from air.workload.secrets import delete_secret as delete

    delete(scope, key, store=_store(request, who))
    return {"scope": scope, "key": key}
