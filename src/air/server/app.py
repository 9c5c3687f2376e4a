"""The FastAPI app of `air server`: authentication, errors as JSON, the API's routers and the pages.

`create_app()` builds it over this process's AIR_HOME. The API lives under `/api/v1`: every route but
`GET /api/v1/health` needs `Authorization: Bearer <token>` (401 without a valid one). air's web pages
(`air.web`) are mounted under `/ui` on the same port (`/` sends a browser there): their login and bearer
tokens go through the same `verify_token`, so a page and the API see the same user, and an unknown path
outside `/ui` stays a JSON 404 of the API rather than a page.
"""

from __future__ import annotations

import threading

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from air import __version__
from air.errors import AirError, NotFoundError, UserInputError
from air.server.deps import API, PAGES, Caller, error_body, http_status, principal
from air.server.tokens import Principal, verify_token
from air.server.uploads import ServerPaths
from air.store.run_store import RunStore
from air.web.security import SecurityHeaders
from air.wire import API_VERSION, API_VERSION_HEADER, Health, WhoAmI


def create_app(*, store: RunStore | None = None, paths: ServerPaths | None = None,
               mlflow_uri: str | None = None, stopping: threading.Event | None = None) -> FastAPI:
    """The server's app over a run store (default: this AIR_HOME's). `stopping` is set when the server
    stops: open streams (the API's follows, the pages' live logs) end then, so shutdown never waits on
    them (a browser's page reconnects to the next server by itself)."""
    from air.server.routes_calls import router as calls_router
    from air.server.routes_runs import router as runs_router
    from air.server.routes_secrets import router as secrets_router

    app = FastAPI(title="air server", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.store = store or RunStore()
    app.state.paths = paths or ServerPaths.here()
    app.state.mlflow_uri = mlflow_uri
    app.state.stopping = stopping

    @app.exception_handler(AirError)
    async def air_error(request: Request, exc: AirError) -> JSONResponse:
        return JSONResponse(error_body(exc).model_dump(mode="json"), status_code=http_status(exc))

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:5])
        return JSONResponse(error_body(UserInputError(f"Invalid request: {problems}")).model_dump(mode="json"),
                            status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = NotFoundError(f"No such API route: {request.method} {request.url.path}") if exc.status_code == 404 \
            else UserInputError(str(exc.detail))
        return JSONResponse(error_body(err).model_dump(mode="json"), status_code=exc.status_code)

    @app.get(API + "/health")
    def health() -> Health:
        # The walls around runs (air.server.isolation); an app made without `air server start` has none.
        # and its MLflow's state (starting, ready, failed; off: none of its own), air.server.mlflow_server.
        mlflow = getattr(app.state, "mlflow_state", None)
        return Health(status="ok", version=__version__, api_version=API_VERSION,
                      isolation=getattr(app.state, "isolation", "") or "none",
                      mlflow=mlflow.as_json() if mlflow is not None else {"state": "off"})

    @app.get(API + "/whoami")
    def whoami(who: Caller) -> WhoAmI:
        return WhoAmI(user=who.user, admin=who.admin, token_id=who.token_id)

    app.include_router(runs_router, prefix=API, dependencies=[Depends(principal)])
    app.include_router(secrets_router, prefix=API, dependencies=[Depends(principal)])
    app.include_router(calls_router, prefix=API, dependencies=[Depends(principal)])
    _mount_pages(app)
    # every answer says which API version the server speaks: a client checks it on each answer, so a
    # server of another version is a clear error, not a misread field
    app.add_middleware(SecurityHeaders, extra=[(API_VERSION_HEADER.lower(), str(API_VERSION))])
    return app


def _mount_pages(app: FastAPI) -> None:
    """air's pages under PAGES: the token's user is the page's user (the name runs record as owner), its
    sessions live in the server's store (kept across restarts, ended with their token), logins, logouts
    and cancels go to the audit log, MLflow's link is the server's MLflow UI."""
    from collections.abc import Mapping

    from fastapi.responses import RedirectResponse

    from air.server.audit import record
    from air.server.tokens import verify_token_id
    from air.tracking.store import is_http
    from air.web import WebUser, create_web_app

    store: RunStore = app.state.store

    def page_user(found: Principal | None) -> WebUser | None:
        return WebUser(found.user, admin=found.admin, token_id=found.token_id) if found else None

    def audit(actor: str, action: str, target: str | None, detail: Mapping[str, object]) -> None:
        record(store, actor, action, target, detail)

    def mlflow_ui() -> str | None:
        uri = app.state.mlflow_uri
        return uri.rstrip("/") if uri and is_http(uri) else None

    from air.server.visibility import current_policy

    pages = create_web_app(store, authenticator=lambda token: page_user(verify_token(store, token)),
                           token_holder=lambda token_id: page_user(verify_token_id(store, token_id)),
                           mlflow_url=mlflow_ui, audit=audit, access=current_policy)

    @app.get("/", include_in_schema=False)
    def home() -> RedirectResponse:
        return RedirectResponse(PAGES + "/runs", status_code=303)

    pages.state.stopping = app.state.stopping
    app.mount(PAGES, pages)

