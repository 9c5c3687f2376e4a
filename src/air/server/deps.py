"""What every route of `air server` shares, below them all: the caller (`Caller`, from the bearer token),
the store, bounded request bodies (`json_body`, `read_limited`, `parse_request`) and errors as the API
answers them (`error_body`, `AuthError`). The app (air.server.app) and the routes import it; it imports
no route, so the server's modules form no circle.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, TypeVar

from fastapi import Depends, Request
from pydantic import BaseModel, ValidationError

from air.bounds import MAX_JSON_BYTES, json_loads_bounded
from air.constants import SERVER_MAX_UPLOAD_BYTES
from air.errors import AirError, NotFoundError, UserInputError
from air.server.tokens import Principal, verify_token
from air.store.run_store import RunStore
from air.web.auth import bearer_token
from air.wire import ErrorBody, ErrorEvent

API = "/api/v1"
#: Where the web pages are mounted.
PAGES = "/ui"


class AuthError(AirError):
    """No valid token (401), or a valid one that may not do this (403)."""

    exit_code = 2
    kind = "USER"

    def __init__(self, message: str, *, status: int, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.status = status
        self.code = "UNAUTHENTICATED" if status == 401 else "PERMISSION_DENIED"


class PayloadTooLarge(UserInputError):
    code = "PAYLOAD_TOO_LARGE"
    http_status = 413


def error_body(exc: AirError) -> ErrorEvent:
    """An error as the API answers it (the CLI's --json error envelope has the same fields); also a failed
    follow stream's last line."""
    return ErrorEvent(error=ErrorBody(code=exc.code, kind=exc.kind, message=exc.message, hint=exc.hint,
                                      exit_code=exc.exit_code))


def http_status(exc: AirError) -> int:
    if isinstance(exc, AuthError):
        return exc.status
    if isinstance(exc, NotFoundError):
        return 404
    if getattr(exc, "http_status", None):
        return int(exc.http_status)  # type: ignore[attr-defined]
    return 400 if isinstance(exc, UserInputError) else 500


def store_of(request: Request) -> RunStore:
    return request.app.state.store


def principal(request: Request) -> Principal:
    """The caller, from the bearer token; 401 when there is none or it is not valid."""
    found = verify_token(store_of(request), bearer_token(request))
    if found is None:
        given = request.headers.get("authorization")
        raise AuthError("A valid air token is required." if given else "No token given.", status=401,
                        hint="Send Authorization: Bearer <token> (AIR_TOKEN, or the profile's token_path); "
                        "an admin makes one with: air server token create NAME")
    return found


def token_still_valid(request: Request) -> bool:
    """Whether the request's bearer token is still valid (a long stream asks again as it goes)."""
    return verify_token(store_of(request), bearer_token(request)) is not None


def pages_base(request: Request) -> str:
    """The pages' address as this request reached the server (what a link for its caller should use)."""
    return str(request.base_url).rstrip("/") + PAGES


#: A route's caller: `who: Caller` (401 before the route runs when the token is not valid).
Caller = Annotated[Principal, Depends(principal)]


async def read_limited(request: Request, limit: int = SERVER_MAX_UPLOAD_BYTES) -> AsyncIterator[bytes]:
    """The request body in chunks; 413 as soon as it is (or says it will be) larger than `limit`."""
    declared = request.headers.get("content-length")
    too_big = PayloadTooLarge(f"The request body is larger than the server accepts ({limit >> 20} MiB).",
                              hint="Keep large data out of the code snapshot (.gitignore) and read it on the nodes.")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise too_big
    seen = 0
    async for chunk in request.stream():
        seen += len(chunk)
        if seen > limit:
            raise too_big
        yield chunk


async def json_body(request: Request, limit: int = MAX_JSON_BYTES) -> object:
    """The request body as JSON, within the bounds of air.bounds (size, depth, 64-bit integers): a body
    past them is a 4xx that says which, never a 500."""
    data = b"".join([chunk async for chunk in read_limited(request, limit)])
    return json_loads_bounded(data)


_ModelT = TypeVar("_ModelT", bound=BaseModel)


def parse_request(model: type[_ModelT], body: object, what: str) -> _ModelT:
    """A request body as `model`, or a UserInputError (400) that names every wrong field and the fields
    the request takes."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}"
                             for e in exc.errors()[:5])
        fields = ", ".join(model.model_fields)
        raise UserInputError(f"Malformed {what}: {problems}.", hint=f"A {what} takes: {fields}.") from None

