"""The web pages over the run store: runs, one run (attempts, logs, spec, charts, cancel), capacity, login.

`create_web_app()` builds a self-contained Starlette app: `air ui` serves it on loopback without login;
`air server` mounts it under `/ui` (air.server.app) so the pages share its port and tokens. Every page is server-rendered HTML that reads completely with
JavaScript off; `static/air.js` only adds live refresh and the live log stream (SSE). The data comes
from `air.runs.views` (the CLI's `--json` reads the same functions).
"""

from __future__ import annotations

import getpass
import os
import secrets
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jinja2
from markupsafe import escape
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from air.constants import WEB_REFRESH_MS
from air.errors import AirError, NotFoundError, UserInputError
from air.runs import views
from air.runs.store import RunStore
from air.web.auth import (
    SESSION_COOKIE,
    Authenticator,
    Forbidden,
    LoginRequired,
    SessionSigner,
    WebUser,
    may_cancel,
    request_user,
)
from air.web.charts import line_chart

HERE = Path(__file__).parent
#: Statuses whose colour class is their own name (the stylesheet has one rule each).
STATUS_CLASSES = {
    "PENDING": "wait", "QUEUED": "wait", "WAITING_FOR_RETRY": "wait", "RUNNING": "run",
    "TERMINATING": "run", "SUCCESS": "ok", "FAILED": "bad", "TIMEDOUT": "bad", "INTERNAL_ERROR": "bad",
    "CANCELED": "off",
}


def _when(stamp: str | None) -> str:
    return stamp.replace("T", " ")[:19] if stamp else "-"


def _templates() -> Jinja2Templates:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"), autoescape=True)
    env.filters.update(duration=views.duration_text, when=_when, chart=line_chart,
                       status_class=lambda s: STATUS_CLASSES.get(str(s), "off"))
    return Jinja2Templates(env=env)


def _local_user() -> WebUser:
    try:
        return WebUser(getpass.getuser(), admin=True)
    except (KeyError, OSError):
        return WebUser(str(os.getuid()), admin=True)


def create_web_app(
    store: RunStore | Callable[[], RunStore] | None = None,
    *,
    authenticator: Authenticator | None = None,
    session_secret: bytes | None = None,
    mlflow_url: Callable[[], str | None] | None = None,
) -> Starlette:
    """The pages as one ASGI app.

    `store`: the run store (or a function returning it; default: AIR_HOME's). `authenticator`: token ->
    `WebUser` or None; with it, every page needs a login (cookie) or a bearer token; without it (loopback
    `air ui`) the local user sees and cancels everything. `session_secret` signs session cookies (default:
    random per process, so a restart logs browsers out). `mlflow_url`: the MLflow UI's address, for the
    header link (None: no link).
    """
    open_store: Callable[[], RunStore]
    if store is None:
        default = RunStore()
        open_store = lambda: default  # noqa: E731
    elif isinstance(store, RunStore):
        open_store = lambda: store  # noqa: E731
    else:
        open_store = store
    signer = SessionSigner(session_secret or secrets.token_bytes(32))
    local_user = _local_user()
    templates = _templates()
    auth_on = authenticator is not None

    def user_of(request: Request) -> WebUser:
        return request_user(request, authenticator, signer, local_user)

    def base(request: Request) -> str:
        return str(request.scope.get("root_path", "")).rstrip("/")

    def render(request: Request, name: str, user: WebUser | None, status_code: int = 200,
               **context: Any) -> Response:
        context.update(user=user, auth_on=auth_on, base=base(request), refresh_ms=WEB_REFRESH_MS,
                       mlflow_ui=mlflow_url() if mlflow_url else None)
        return templates.TemplateResponse(request, name, context, status_code=status_code)

    def runs_page(request: Request) -> Response:
        user = user_of(request)
        q = request.query_params
        try:
            page = int(q.get("page") or 1)
        except ValueError:
            page = 1
        data = views.run_list_page(
            open_store(), status=q.get("status"), experiment=q.get("experiment"), user=q.get("user"),
            accelerator=q.get("accelerator"), page=page)
        query = {k: v for k, v in data["filters"].items() if v}
        links = {
            "prev": "?" + urllib.parse.urlencode({**query, "page": page - 1}) if page > 1 else None,
            "next": "?" + urllib.parse.urlencode({**query, "page": page + 1}) if data["has_next"] else None,
        }
        return render(request, "runs.html", user, data=data, links=links,
                      statuses=[*views.STATUS_GROUPS, *STATUS_CLASSES])

    def run_page(request: Request) -> Response:
        user = user_of(request)
        store = open_store()
        run = store.get_run(request.path_params["run_id"])
        q = request.query_params
        here = f"{request.url.scheme}://{request.url.netloc}{base(request)}"
        detail = views.run_detail(store, run, pages_base=here)
        attempts = views.attempt_views(store, run)
        attempt = _int(q.get("attempt"), run.current_attempt if run.current_attempt is not None else 0)
        chosen = next((a for a in attempts if a["index"] == attempt), None)
        files = views.log_files(run, attempt)
        failing = chosen["failing"] if chosen else None
        default_log = failing if failing is not None and failing < len(files) else 0
        index = _int(q.get("log"), default_log)
        if not 0 <= index < len(files):
            index = default_log
        query = q.get("q") or ""
        lines = min(max(_int(q.get("lines"), views.LOG_TAIL_LINES), 1), views.LOG_SEARCH_LINES)
        log = views.log_view(run, files[index]["path"], lines=lines, query=query) if files else None
        # Live: the latest attempt of an active run (or attempt 0 of one that has not started: its log
        # is followed from the moment it appears).
        live = not run.is_terminal and attempt == (run.current_attempt or 0)
        return render(
            request, "run.html", user, run=detail, attempts=attempts, attempt=attempt, files=files,
            log_index=index, log=log, query=query, lines=lines, live=live, failing=failing,
            spec=views.masked_spec(run), metrics=views.attempt_metrics(chosen["mlflow_run_id"] if chosen else None),
            can_cancel=not run.is_terminal and may_cancel(user, run.user, auth_on=auth_on),
            notice=f"Canceled: run {run.id} is {run.status.value}." if q.get("canceled") else None)

    async def log_stream(request: Request) -> Response:
        await run_in_threadpool(user_of, request)
        store = open_store()
        run = await run_in_threadpool(store.get_run, request.path_params["run_id"])
        q = request.query_params
        attempt = _int(q.get("attempt"), run.current_attempt or 0)
        files = views.log_files(run, attempt)
        index = _int(q.get("log"), 0)
        if not 0 <= index < len(files):
            raise NotFoundError(f"Run {run.id} has no log {index}.")
        mask = await run_in_threadpool(views.log_masker, run)
        await run_in_threadpool(mask, "")  # fails closed before any line is sent
        from air.web.stream import follow_log

        resume = request.headers.get("last-event-id") or q.get("offset")
        offset = _int(resume, 0) if resume else None
        def signed_in() -> bool:
            try:
                user_of(request)
            except LoginRequired:
                return False
            return True

        stream = follow_log(request, store, run.id, files[index]["path"], offset, mask,
                            attempt=attempt, signed_in=signed_in)
        return StreamingResponse(stream, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    def cancel(request: Request) -> Response:
        from air.runs.cancel import cancel_run

        _same_origin(request)
        user = user_of(request)
        store = open_store()
        run = store.get_run(request.path_params["run_id"])
        if not may_cancel(user, run.user, auth_on=auth_on):
            raise Forbidden(f"Only {run.user} (who submitted it) or an admin may cancel run {run.id}.")
        cancel_run(store, run.id)
        return RedirectResponse(f"{base(request)}/runs/{run.id}?canceled=1", status_code=303)

    def capacity_page(request: Request) -> Response:
        user = user_of(request)
        return render(request, "capacity.html", user, data=views.capacity_view(open_store()))

    async def login(request: Request) -> Response:
        target = _safe_next(request.query_params.get("next"), base(request))
        if not auth_on:
            return RedirectResponse(target, status_code=303)
        if request.method == "GET":
            return render(request, "login.html", None, next=target, error=None)
        form = urllib.parse.parse_qs((await request.body()).decode("utf-8", "replace"))
        token = (form.get("token") or [""])[0].strip()
        target = _safe_next((form.get("next") or [target])[0], base(request))
        user = await run_in_threadpool(authenticator, token) if token and authenticator else None
        if user is None:
            return render(request, "login.html", None, status_code=401, next=target,
                          error="That token is not valid (unknown, revoked or mistyped).")
        response = RedirectResponse(target, status_code=303)
        response.set_cookie(SESSION_COOKIE, signer.dumps(token), httponly=True, samesite="strict",
                            secure=request.url.scheme == "https", path=base(request) or "/")
        return response

    def logout(request: Request) -> Response:
        response = RedirectResponse(f"{base(request)}/login", status_code=303)
        response.delete_cookie(SESSION_COOKIE, path=base(request) or "/")
        return response

    def home(request: Request) -> Response:
        return RedirectResponse(f"{base(request)}/runs", status_code=303)

    async def login_required(request: Request, exc: Exception) -> Response:
        wants_page = request.method == "GET" and "text/event-stream" not in request.headers.get("accept", "")
        if wants_page and "authorization" not in request.headers:
            target = urllib.parse.quote(request.url.path + ("?" + request.url.query if request.url.query else ""))
            return RedirectResponse(f"{base(request)}/login?next={target}", status_code=303)
        return PlainTextResponse("Login required: send 'Authorization: Bearer TOKEN' or log in at /login.",
                                 status_code=401, headers={"WWW-Authenticate": "Bearer"})

    async def air_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, AirError)
        code = 404 if isinstance(exc, NotFoundError) else 400 if isinstance(exc, UserInputError) else 500
        user = None if auth_on else local_user
        return render(request, "error.html", user, status_code=code, message=exc.message, hint=exc.hint)

    async def forbidden(request: Request, exc: Exception) -> Response:
        return HTMLResponse(f"<p>{escape(str(exc))}</p>", status_code=403)

    routes = [
        Route("/", home),
        Route("/runs", runs_page),
        Route("/runs/{run_id}", run_page),
        Route("/runs/{run_id}/logs/stream", log_stream),
        Route("/runs/{run_id}/cancel", cancel, methods=["POST"]),
        Route("/capacity", capacity_page),
        Route("/login", login, methods=["GET", "POST"]),
        Route("/logout", logout, methods=["POST"]),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]
    return Starlette(routes=routes, exception_handlers={
        LoginRequired: login_required, AirError: air_error, Forbidden: forbidden})


def _int(text: str | None, default: int) -> int:
    try:
        return int(text) if text not in (None, "") else default
    except ValueError:
        return default


def _same_origin(request: Request) -> None:
    """A form posted from another site is refused: on `air ui` no cookie is needed, so any page the user
    visits could otherwise post to the loopback address (the server's cookie is SameSite=Strict too)."""
    origin = request.headers.get("origin")
    if origin and origin != "null" and urllib.parse.urlsplit(origin).netloc != request.headers.get("host"):
        raise Forbidden(f"Refused a cancel posted from another site ({origin}).")


def _safe_next(target: str | None, base: str) -> str:
    """Where to go after login: a path on this site only (never another host)."""
    if target and target.startswith("/") and not target.startswith("//"):
        return target
    return f"{base}/runs"


__all__ = ["create_web_app"]
