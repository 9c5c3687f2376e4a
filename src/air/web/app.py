"""The web pages over the run store: runs, one run (attempts, logs, spec, charts, cancel), capacity, login.

`create_web_app()` builds a self-contained Starlette app: `air ui` serves it on loopback without login;
`air server` mounts it under `/ui` (air.server.app) so the pages share its port and tokens. Every page is server-rendered HTML that reads completely with
JavaScript off; `static/air.js` only adds live refresh and the live log stream (SSE). The data comes
from `air.views.query` (the CLI's `--json` reads the same functions).
"""

from __future__ import annotations

import datetime as _dt
import getpass
import os
import secrets
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import yaml
from markupsafe import escape
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from air.constants import WEB_REFRESH_MS
from air.errors import AirError, NotFoundError, UserInputError
from air.store.access import Level, Policy, Viewer
from air.store.run_store import Run, RunStore
from air.views import query as views
from air.web.auth import (
    SESSION_COOKIE,
    Authenticator,
    Caller,
    Forbidden,
    LoginRequired,
    TokenHolder,
    WebSessions,
    WebUser,
    check_form_post,
    request_caller,
    same_site,
)
from air.web.charts import line_chart
from air.web.security import SecurityHeaders

HERE = Path(__file__).parent
#: What the pages tell the server's audit log: (actor, action, target, detail); `air server` passes
#: air.server.audit.record over its store.
AuditHook = Callable[[str, str, "str | None", Mapping[str, object]], None]
#: Statuses whose colour class is their own name (the stylesheet has one rule each).
STATUS_CLASSES = {
    "PENDING": "wait", "QUEUED": "wait", "WAITING_FOR_RETRY": "wait", "RUNNING": "run",
    "TERMINATING": "run", "SUCCESS": "ok", "FAILED": "bad", "TIMEDOUT": "bad", "INTERNAL_ERROR": "bad",
    "CANCELED": "off",
}


def _when(stamp: str | None) -> str:
    """An RFC 3339 time in the server's zone, with the zone named ("2025-11-25 20:15:03 CET"): a team
    spread over zones reads it right."""
    if not stamp:
        return "-"
    try:
        moment = _dt.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        return stamp
    return moment.astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")


#: MLflow 3's UI shows its GenAI view unless told otherwise (its `workflowType`, kept in the browser);
#: this query in the link's route opens the model-training view (runs, metrics, charts) instead.
MLFLOW_TRAINING_VIEW = "workflowType=machine_learning"


def _training_view(url: str | None) -> str | None:
    """An MLflow UI link (`…/#/experiments/E/runs/R`) that opens in the training-runs view."""
    if not url or "#/" not in url:
        return url
    return url + ("&" if "?" in url.split("#/", 1)[1] else "?") + MLFLOW_TRAINING_VIEW


def _block_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    """Multi-line strings as `|` blocks: a spec's command reads as it was written."""
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value.strip() else None)


class _SpecDumper(yaml.SafeDumper):
    pass


_SpecDumper.add_representer(str, _block_str)


def _as_written(run: Run) -> dict[str, Any]:
    """The spec as submitted, its secret values hidden (or why it is not shown), re-written with `|`
    blocks for multi-line strings (the store keeps a command as one escaped string) and masked once more
    as written: a secret value that the escaped form hid from the masker is hidden in the block form too."""
    try:
        mask = views.log_masker(run)
        text = mask(run.spec_yaml)
        data = yaml.safe_load(text) if text else None
        if isinstance(data, dict):
            text = mask(yaml.dump(data, Dumper=_SpecDumper, sort_keys=False, allow_unicode=True, width=120))
    except AirError as exc:
        return {"text": "", "error": exc.message}
    except yaml.YAMLError:
        pass  # shown as stored (masked)
    return {"text": text, "error": None}


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
    token_holder: TokenHolder | None = None,
    mlflow_url: Callable[[], str | None] | None = None,
    audit: AuditHook | None = None,
    access: Callable[[], Policy] | None = None,
    hosts: Sequence[str] | None = None,
) -> Starlette:
    """The pages as one ASGI app.

    `store`: the run store (or a function returning it; default: AIR_HOME's). `authenticator`: token ->
    `WebUser` (with its token id) or None; with it, every page needs a login (a session cookie) or a bearer
    token; without it (loopback `air ui`) the local user sees and cancels everything. `token_holder`: a
    token's id -> its user while the token is valid (asked on every request a session makes; without it
    nobody can log in, only bearer tokens work). `mlflow_url`: the MLflow UI's address, for the header link
    (None: no link). `audit`: told of logins, logouts and cancels. `access`: the server's access policy
    (air.store.access; default visibility and groups): a run the user may not view is a 404 page and is not
    listed, cancel needs CAN_MANAGE_RUN; None (`air ui`): one user, who sees everything. `hosts`: the only
    Host names answered (`air ui` on loopback: a DNS-rebinding page may not read it); None: any.
    """
    open_store: Callable[[], RunStore]
    if store is None:
        default = RunStore()
        open_store = lambda: default  # noqa: E731
    elif isinstance(store, RunStore):
        open_store = lambda: store  # noqa: E731
    else:
        open_store = store
    sessions = WebSessions(open_store)
    #: `air ui`'s forms carry this (no session there): another site's page cannot read it.
    local_csrf = secrets.token_urlsafe(32)
    local_user = _local_user()
    templates = _templates()
    auth_on = authenticator is not None

    def caller_of(request: Request) -> Caller:
        caller = request_caller(request, authenticator, token_holder, sessions, local_user, local_csrf)
        request.state.csrf = caller.csrf  # for the forms render() writes
        return caller

    def user_of(request: Request) -> WebUser:
        return caller_of(request).user

    def told(actor: str, action: str, target: str | None, **detail: object) -> None:
        if audit is not None and auth_on:
            audit(actor, action, target, detail)

    def policy() -> Policy:
        return access() if access is not None else Policy()

    def viewer(user: WebUser) -> Viewer:
        return policy().viewer(user.name, admin=user.admin or not auth_on)

    def seen_run(store: RunStore, run_id: str, user: WebUser) -> Run:
        """The run, if `user` may view it; else the very 404 of a run that does not exist."""
        run = store.get_run(run_id)
        if not policy().allows(viewer(user), run):
            raise NotFoundError(f"Run {run_id} not found.")
        return run

    def may_manage_run(user: WebUser, run: Run) -> bool:
        return policy().allows(viewer(user), run, Level.CAN_MANAGE_RUN)

    def base(request: Request) -> str:
        return str(request.scope.get("root_path", "")).rstrip("/")

    def render(request: Request, name: str, user: WebUser | None, status_code: int = 200,
               **context: object) -> Response:
        context.update(user=user, auth_on=auth_on, base=base(request), refresh_ms=WEB_REFRESH_MS,
                       mlflow_ui=mlflow_url() if mlflow_url else None, csrf=getattr(request.state, "csrf", None))
        return templates.TemplateResponse(request, name, context, status_code=status_code)

    def runs_page(request: Request) -> Response:
        user = user_of(request)
        q = request.query_params
        try:
            page = int(q.get("page") or 1)
        except ValueError:
            page = 1
        # Whose runs: yours on a server, as `air list runs` (--all-users for everyone's); on `air ui`
        # every run is the local user's, so there is nothing to toggle. A `user` filter names whose.
        who = "all" if not auth_on or q.get("who") == "all" else "mine"
        owner = q.get("user") or (user.name if who == "mine" else None)
        data = views.run_list_page(
            open_store(), status=q.get("status"), experiment=q.get("experiment"), user=owner,
            accelerator=q.get("accelerator"), page=page, visible_to=policy().list_filter(viewer(user)))
        data["filters"]["user"] = q.get("user") or ""
        query = {k: v for k, v in data["filters"].items() if v}
        if auth_on and who == "all":
            query["who"] = "all"
        links = {
            "prev": "?" + urllib.parse.urlencode({**query, "page": page - 1}) if page > 1 else None,
            "next": "?" + urllib.parse.urlencode({**query, "page": page + 1}) if data["has_next"] else None,
            "mine": "?" + urllib.parse.urlencode({k: v for k, v in query.items() if k != "who"}),
            "all": "?" + urllib.parse.urlencode({**query, "who": "all"}),
        }
        return render(request, "runs.html", user, data=data, links=links, who=who,
                      statuses=[*views.STATUS_GROUPS, *STATUS_CLASSES])

    def run_page(request: Request) -> Response:
        user = user_of(request)
        store = open_store()
        run = seen_run(store, request.path_params["run_id"], user)
        q = request.query_params
        here = f"{request.url.scheme}://{request.url.netloc}{base(request)}"
        detail = views.run_detail(store, run, pages_base=here)
        attempts = views.attempt_views(store, run)
        for a in attempts:
            a["mlflow_url"] = _training_view(a["mlflow_url"])
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
            spec=_as_written(run), stacks=views.attempt_stacks(run, attempt), metrics=views.attempt_metrics(chosen["mlflow_run_id"] if chosen else None),
            can_cancel=not run.is_terminal and may_manage_run(user, run),
            notice=f"Canceled: run {run.id} is {run.status.value}." if q.get("canceled") else None)

    async def log_stream(request: Request) -> Response:
        user = await run_in_threadpool(user_of, request)
        store = open_store()
        run = await run_in_threadpool(seen_run, store, request.path_params["run_id"], user)
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
            """Still signed in, and still allowed to see the run (its grants may be taken back)."""
            try:
                seen_run(store, run.id, user_of(request))
            except (LoginRequired, NotFoundError):
                return False
            return True

        stream = follow_log(request, store, run.id, files[index]["label"], files[index]["index"], offset, mask,
                            attempt=attempt, signed_in=signed_in)
        return StreamingResponse(stream, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    async def cancel(request: Request) -> Response:
        form = await _form(request)
        return await run_in_threadpool(cancel_posted, request, form)

    def cancel_posted(request: Request, form: dict[str, list[str]]) -> Response:
        from air.runs.cancel import cancel_run, canceled_by

        caller = caller_of(request)
        check_form_post(request, caller, form)
        user = caller.user
        store = open_store()
        run = seen_run(store, request.path_params["run_id"], user)
        if not may_manage_run(user, run):
            raise Forbidden(f"Only {run.user} (who submitted it), an admin or a CAN_MANAGE_RUN grant in its "
                            f"permissions may cancel run {run.id}.")
        reason = canceled_by(user.name, admin=user.admin and auth_on, owner=run.user)
        if not run.is_terminal:
            told(user.name, "run.cancel", run.id, owner=run.user, via="pages", reason=reason)
        cancel_run(store, run.id, reason=reason)
        return RedirectResponse(f"{base(request)}/runs/{run.id}?canceled=1", status_code=303)

    def capacity_page(request: Request) -> Response:
        user = user_of(request)
        store = open_store()
        data = views.capacity_view(store)
        if policy().list_filter(viewer(user)) is not None:  # `private`: others' runs hold slots unnamed
            data = _unnamed_runs(data, lambda run_id: _sees(store, run_id, user))
        return render(request, "capacity.html", user, data=data)

    def _sees(store: RunStore, run_id: str, user: WebUser) -> bool:
        try:
            seen_run(store, run_id, user)
        except NotFoundError:
            return False
        return True

    async def login(request: Request) -> Response:
        target = _safe_next(request.query_params.get("next"), base(request))
        if not auth_on:
            return RedirectResponse(target, status_code=303)
        if request.method == "GET":
            return render(request, "login.html", None, next=target, error=None)
        if not same_site(request):  # another site may not sign a browser in (to its own account)
            raise Forbidden("Refused a login posted from another site.")
        form = await _form(request)
        token = (form.get("token") or [""])[0].strip()
        target = _safe_next((form.get("next") or [target])[0], base(request))
        user = await run_in_threadpool(authenticator, token) if token and authenticator else None
        if user is None or token_holder is None or not user.token_id:
            return render(request, "login.html", None, status_code=401, next=target,
                          error="That token is not valid (unknown, revoked or mistyped).")
        session_id, _ = await run_in_threadpool(sessions.open, user)
        await run_in_threadpool(told, user.name, "login", user.token_id)
        response = RedirectResponse(target, status_code=303)
        response.set_cookie(SESSION_COOKIE, session_id, max_age=int(sessions.ttl_s), httponly=True,
                            samesite="strict", secure=request.url.scheme == "https", path="/")  # "/": the MLflow door too
        return response

    async def logout(request: Request) -> Response:
        form = await _form(request)

        def end() -> None:
            caller = caller_of(request)
            check_form_post(request, caller, form)
            if caller.session is not None:
                sessions.revoke(request.cookies.get(SESSION_COOKIE) or "")
                told(caller.user.name, "logout", caller.session.token_id)

        await run_in_threadpool(end)
        response = RedirectResponse(f"{base(request)}/login", status_code=303)
        response.delete_cookie(SESSION_COOKIE, path="/", secure=request.url.scheme == "https",
                               httponly=True, samesite="strict")
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
    app = Starlette(routes=routes, exception_handlers={
        LoginRequired: login_required, AirError: air_error, Forbidden: forbidden})
    if hosts is not None:  # before any page is read (its refusal still gets the headers below)
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(hosts))
    app.add_middleware(SecurityHeaders)
    app.state.user_of = user_of  # the server's MLflow door signs page users in the same way
    return app


def _unnamed_runs(data: dict[str, Any], sees: Callable[[str], bool]) -> dict[str, Any]:
    """The capacity page without the ids, experiments and links of runs the user may not see: their slots
    still count as held (the totals stay true), but say nothing of whose run holds them."""
    for pool in data["pools"]:
        for slot in pool["slots"]:
            if slot["run_id"] and not sees(slot["run_id"]):
                slot.update(run_id=None, held=True)
        pool["holders"] = [h for h in pool["holders"] if sees(h["run_id"])]
    named = data.get("named_pools") or {}
    for row in named.get("pools") or ():
        row["runs"] = [r for r in row["runs"] if sees(r)]
    data["remote"] = [r for r in data["remote"] if sees(r["id"])]
    return data


def _int(text: str | None, default: int) -> int:
    try:
        return int(text) if text not in (None, "") else default
    except ValueError:
        return default


async def _form(request: Request, limit: int = 64 << 10) -> dict[str, list[str]]:
    """A posted form's fields (the pages' forms are small: a larger body is refused, not read whole)."""
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise Forbidden("Refused a form post larger than the pages ever send.")
    return urllib.parse.parse_qs(body.decode("utf-8", "replace"))


def _safe_next(target: str | None, base: str) -> str:
    """Where to go after login: a path on this site only (never another host)."""
    if target and target.startswith("/") and not target.startswith("//"):
        return target
    return f"{base}/runs"


__all__ = ["create_web_app"]
