"""The FastAPI app of `air server`: authentication, errors as JSON, and the routers.

`create_app()` builds it over this process's AIR_HOME; `app.mount(path, sub_app)` adds web pages (their
login calls `air.server.tokens.verify_token`). Every route but `GET /api/v1/health` needs
`Authorization: Bearer <token>`: 401 without a valid one.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from air import __version__
from air.errors import AirError, NotFoundError, UserInputError
from air.runs.store import RunStore
from air.server.tokens import Principal, verify_token
from air.server.uploads import ServerPaths

API = "/api/v1"


class AuthError(AirError):
    """No valid token (401), or a valid one that may not do this (403)."""

    exit_code = 2
    kind = "USER"

    def __init__(self, message: str, *, status: int, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.status = status
        self.code = "UNAUTHENTICATED" if status == 401 else "PERMISSION_DENIED"


def error_body(exc: AirError) -> dict[str, Any]:
    """An error as the API answers it (the CLI's --json error envelope has the same fields)."""
    return {"error": {"code": exc.code, "kind": exc.kind, "message": exc.message, "hint": exc.hint,
                      "exit_code": exc.exit_code}}


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
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    found = verify_token(store_of(request), token.strip()) if scheme.lower() == "bearer" else None
    if found is None:
        raise AuthError("A valid air token is required." if header else "No token given.", status=401,
                        hint="Send Authorization: Bearer <token> (AIR_TOKEN, or the profile's token_path); "
                        "an admin makes one with: air server token create NAME")
    return found


#: A route's caller: `who: Caller` (401 before the route runs when the token is not valid).
Caller = Annotated[Principal, Depends(principal)]


def create_app(*, store: RunStore | None = None, paths: ServerPaths | None = None,
               mlflow_uri: str | None = None) -> FastAPI:
    """The server's app over a run store (default: this AIR_HOME's)."""
    from air.server.routes_calls import router as calls_router
    from air.server.routes_runs import router as runs_router
    from air.server.routes_secrets import router as secrets_router

    app = FastAPI(title="air server", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.store = store or RunStore()
    app.state.paths = paths or ServerPaths.here()
    app.state.mlflow_uri = mlflow_uri

    @app.exception_handler(AirError)
    async def air_error(request: Request, exc: AirError) -> JSONResponse:
        return JSONResponse(error_body(exc), status_code=http_status(exc))

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:5])
        return JSONResponse(error_body(UserInputError(f"Invalid request: {problems}")), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = NotFoundError(f"No such API route: {request.method} {request.url.path}") if exc.status_code == 404 \
            else UserInputError(str(exc.detail))
        return JSONResponse(error_body(err), status_code=exc.status_code)

    @app.get(API + "/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "version": __version__}

    @app.get(API + "/whoami")
    def whoami(who: Caller) -> dict[str, Any]:
        return {"user": who.user, "admin": who.admin, "token_id": who.token_id}

    app.include_router(runs_router, prefix=API, dependencies=[Depends(principal)])
    app.include_router(secrets_router, prefix=API, dependencies=[Depends(principal)])
    app.include_router(calls_router, prefix=API, dependencies=[Depends(principal)])
    return app


__all__ = ["API", "AuthError", "Caller", "create_app", "error_body", "principal", "store_of"]
