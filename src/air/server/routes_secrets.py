"""`/api/v1/secrets`: each user's own secret store on the server. Values go in, never out."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request

from air.bounds import MAX_SECRET_BYTES, MAX_SECRETS_PER_USER
from air.errors import UserInputError
from air.server.deps import Caller, json_body, parse_request
from air.server.tokens import Principal
from air.wire import SecretList, SecretPutRequest, SecretRef

router = APIRouter()


def _store(request: Request, who: Principal) -> Path:
    return request.app.state.paths.user_secrets(who.user)


def _check_room(request: Request, who: Principal, scope: str, key: str) -> None:
    """A new secret needs room: each user keeps at most MAX_SECRETS_PER_USER (replacing one always fits)."""
    from air.workload.secrets import list_secrets as listed

    kept = listed(store=_store(request, who))
    if (scope, key) not in kept and len(kept) >= MAX_SECRETS_PER_USER:
        raise UserInputError(f"You already keep {len(kept)} secrets on this server, the most a user may keep "
                             f"({MAX_SECRETS_PER_USER}).", hint="Delete ones you no longer use: air secrets delete SCOPE KEY")


@router.get("/secrets")
def list_secrets(request: Request, who: Caller) -> SecretList:
    from air.workload.secrets import list_secrets as listed

    refs = [SecretRef(scope=scope, key=key) for scope, key in listed(store=_store(request, who))]
    return SecretList(secrets=refs)


@router.put("/secrets/{scope}/{key}")
async def put_secret(request: Request, scope: str, key: str, who: Caller) -> SecretRef:
    from starlette.concurrency import run_in_threadpool

    from air.workload.secrets import put_secret as put

    value = parse_request(SecretPutRequest, await json_body(request), "secret").value
    size = len(value.encode("utf-8", errors="surrogatepass"))
    if size > MAX_SECRET_BYTES:
        raise UserInputError(f"The value of secret {scope[:128]}/{key[:128]} is {size} bytes; a secret may hold at "
                             f"most {MAX_SECRET_BYTES} bytes ({MAX_SECRET_BYTES >> 10} KiB).",
                             hint="Keep large credentials (key files, configs) in a file of the code snapshot "
                             "or on the nodes, and put only a token or password in a secret.")
    await run_in_threadpool(_check_room, request, who, scope, key)
    await run_in_threadpool(put, scope, key, value, store=_store(request, who))
    return SecretRef(scope=scope, key=key)


@router.delete("/secrets/{scope}/{key}")
def delete_secret(request: Request, scope: str, key: str, who: Caller) -> SecretRef:
    from air.workload.secrets import delete_secret as delete

    delete(scope, key, store=_store(request, who))
    return SecretRef(scope=scope, key=key)
