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


class _Pages:
    """What the pages' handlers share (`request.app.state.pages`; arguments: `create_web_app`'s)."""

    def __init__(self, open_store: Callable[[], RunStore], authenticator: Authenticator | None,
                 token_holder: TokenHolder | None, mlflow_url: Callable[[], str | None] | None,
                 audit: AuditHook | None, access: Callable[[], Policy] | None) -> None:
        self.open_store, self.authenticator, self.token_holder = open_store, authenticator, token_holder
        self.mlflow_url, self.audit, self.access, self.auth_on = mlflow_url, audit, access, authenticator is not None
        self.sessions = WebSessions(open_store)
        self.local_csrf = secrets.token_urlsafe(32)  # `air ui`'s forms carry it (no session there)
        try:
            self.local_user = WebUser(getpass.getuser(), admin=True)
        except (KeyError, OSError):
            self.local_user = WebUser(str(os.getuid()), admin=True)
        env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"), autoescape=True)
        env.filters.update(duration=views.duration_text, when=_when, chart=line_chart,
                           status_class=lambda s: STATUS_CLASSES.get(str(s), "off"))
        self.templates = Jinja2Templates(env=env)

    def caller_of(self, request: Request) -> Caller:
        caller = request_caller(request, self.authenticator, self.token_holder, self.sessions, self.local_user,
                                self.local_csrf)
        request.state.csrf = caller.csrf  # for the forms render() writes
        return caller

    def user_of(self, request: Request) -> WebUser:
        return self.caller_of(request).user

    def told(self, actor: str, action: str, target: str | None, **detail: object) -> None:
        if self.audit is not None and self.auth_on:
            self.audit(actor, action, target, detail)

    def policy(self) -> Policy:
        return self.access() if self.access is not None else Policy()

    def viewer(self, user: WebUser) -> Viewer:
        return self.policy().viewer(user.name, admin=user.admin or not self.auth_on)

    def seen_run(self, store: RunStore, run_id: str, user: WebUser) -> Run:
        """The run, if `user` may view it; else the very 404 of a run that does not exist."""
        run = store.get_run(run_id)
        if not self.policy().allows(self.viewer(user), run):
            raise NotFoundError(f"Run {run_id} not found.")
        return run

    def sees(self, store: RunStore, run_id: str, user: WebUser) -> bool:
        try:
            return self.seen_run(store, run_id, user) is not None
        except NotFoundError:
            return False

    def render(self, request: Request, name: str, user: WebUser | None, status_code: int = 200,
               **context: object) -> Response:
        context.update(user=user, auth_on=self.auth_on, base=_base(request), refresh_ms=WEB_REFRESH_MS,
                       mlflow_ui=self.mlflow_url() if self.mlflow_url else None,
                       csrf=getattr(request.state, "csrf", None))
        return self.templates.TemplateResponse(request, name, context, status_code=status_code)


def _base(request: Request) -> str:
    return str(request.scope.get("root_path", "")).rstrip("/")


def runs_page(request: Request) -> Response:
    p: _Pages = request.app.state.pages
    user = p.user_of(request)
    q = request.query_params
    page = _int(q.get("page"), 1)
    # Whose runs: yours on a server, as `air list runs` (--all-users for everyone's); on `air ui`
    # every run is the local user's, so there is nothing to toggle. A `user` filter names whose.
    who = "all" if not p.auth_on or q.get("who") == "all" else "mine"
    owner = q.get("user") or (user.name if who == "mine" else None)
    data = views.run_list_page(
        p.open_store(), status=q.get("status"), experiment=q.get("experiment"), user=owner,
        accelerator=q.get("accelerator"), page=page, visible_to=p.policy().list_filter(p.viewer(user)))
    data["filters"]["user"] = q.get("user") or ""
    query = {k: v for k, v in data["filters"].items() if v}
    if p.auth_on and who == "all":
        query["who"] = "all"
    links = {
        "prev": "?" + urllib.parse.urlencode({**query, "page": page - 1}) if page > 1 else None,
        "next": "?" + urllib.parse.urlencode({**query, "page": page + 1}) if data["has_next"] else None,
        "mine": "?" + urllib.parse.urlencode({k: v for k, v in query.items() if k != "who"}),
        "all": "?" + urllib.parse.urlencode({**query, "who": "all"}),
    }
    return p.render(request, "runs.html", user, data=data, links=links, who=who,
                    statuses=[*views.STATUS_GROUPS, *STATUS_CLASSES])


def run_page(request: Request) -> Response:
    p: _Pages = request.app.state.pages
    user = p.user_of(request)
    store = p.open_store()
    run = p.seen_run(store, request.path_params["run_id"], user)
    q = request.query_params
    here = f"{request.url.scheme}://{request.url.netloc}{_base(request)}"
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
    return p.render(
        request, "run.html", user, run=detail, attempts=attempts, attempt=attempt, files=files,
        log_index=index, log=log, query=query, lines=lines, live=live, failing=failing,
        spec=_as_written(run), stacks=views.attempt_stacks(run, attempt), metrics=views.attempt_metrics(chosen["mlflow_run_id"] if chosen else None),
        can_cancel=not run.is_terminal and p.policy().allows(p.viewer(user), run, Level.CAN_MANAGE_RUN),
        notice=f"Canceled: run {run.id} is {run.status.value}." if q.get("canceled") else None)


async def log_stream(request: Request) -> Response:
    p: _Pages = request.app.state.pages
    user = await run_in_threadpool(p.user_of, request)
    store = p.open_store()
    run = await run_in_threadpool(p.seen_run, store, request.path_params["run_id"], user)
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
            p.seen_run(store, run.id, p.user_of(request))
        except (LoginRequired, NotFoundError):
            return False
        return True

    stream = follow_log(request, store, run.id, files[index]["label"], files[index]["index"], offset, mask,
                        attempt=attempt, signed_in=signed_in)
    return StreamingResponse(stream, media_type="text/event-stream",
                             headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})


async def cancel(request: Request) -> Response:
    return await run_in_threadpool(_cancel_posted, request, await _form(request))


def _cancel_posted(request: Request, form: dict[str, list[str]]) -> Response:
    from air.runs.cancel import cancel_run, canceled_by

    p: _Pages = request.app.state.pages
    caller = p.caller_of(request)
    check_form_post(request, caller, form)
    user = caller.user
    store = p.open_store()
    run = p.seen_run(store, request.path_params["run_id"], user)
    if not p.policy().allows(p.viewer(user), run, Level.CAN_MANAGE_RUN):
        raise Forbidden(f"Only {run.user} (who submitted it), an admin or a CAN_MANAGE_RUN grant in its "
                        f"permissions may cancel run {run.id}.")
    reason = canceled_by(user.name, admin=user.admin and p.auth_on, owner=run.user)
    if not run.is_terminal:
        p.told(user.name, "run.cancel", run.id, owner=run.user, via="pages", reason=reason)
    cancel_run(store, run.id, reason=reason)
    return RedirectResponse(f"{_base(request)}/runs/{run.id}?canceled=1", status_code=303)


def capacity_page(request: Request) -> Response:
    p: _Pages = request.app.state.pages
    user = p.user_of(request)
    store = p.open_store()
    data = views.capacity_view(store)
    if p.policy().list_filter(p.viewer(user)) is not None:  # `private`: others' runs hold slots unnamed
        data = _unnamed_runs(data, lambda run_id: p.sees(store, run_id, user))
    return p.render(request, "capacity.html", user, data=data)


async def login(request: Request) -> Response:
    p: _Pages = request.app.state.pages
    target = _safe_next(request.query_params.get("next"), _base(request))
    if not p.auth_on:
        return RedirectResponse(target, status_code=303)
    if request.method == "GET":
        return p.render(request, "login.html", None, next=target, error=None)
    if not same_site(request):  # another site may not sign a browser in (to its own account)
        raise Forbidden("Refused a login posted from another site.")
    form = await _form(request)
    token = (form.get("token") or [""])[0].strip()
    target = _safe_next((form.get("next") or [target])[0], _base(request))
    user = await run_in_threadpool(p.authenticator, token) if token and p.authenticator else None
    if user is None or p.token_holder is None or not user.token_id:
        return p.render(request, "login.html", None, status_code=401, next=target,
                        error="That token is not valid (unknown, revoked or mistyped).")
    session_id, _ = await run_in_threadpool(p.sessions.open, user)
    await run_in_threadpool(p.told, user.name, "login", user.token_id)
    response = RedirectResponse(target, status_code=303)
    response.set_cookie(SESSION_COOKIE, session_id, max_age=int(p.sessions.ttl_s), httponly=True,
                        samesite="strict", secure=request.url.scheme == "https", path="/")  # "/": the MLflow door too
    return response


async def logout(request: Request) -> Response:
    p: _Pages = request.app.state.pages
    form = await _form(request)

    def end() -> None:
        caller = p.caller_of(request)
        check_form_post(request, caller, form)
        if caller.session is not None:
            p.sessions.revoke(request.cookies.get(SESSION_COOKIE) or "")
            p.told(caller.user.name, "logout", caller.session.token_id)

    await run_in_threadpool(end)
    response = RedirectResponse(f"{_base(request)}/login", status_code=303)
    response.delete_cookie(SESSION_COOKIE, path="/", secure=request.url.scheme == "https",
                           httponly=True, samesite="strict")
    return response


async def login_required(request: Request, exc: Exception) -> Response:
    wants_page = request.method == "GET" and "text/event-stream" not in request.headers.get("accept", "")
    if wants_page and "authorization" not in request.headers:
        target = urllib.parse.quote(request.url.path + ("?" + request.url.query if request.url.query else ""))
        return RedirectResponse(f"{_base(request)}/login?next={target}", status_code=303)
    return PlainTextResponse("Login required: send 'Authorization: Bearer TOKEN' or log in at /login.",
                             status_code=401, headers={"WWW-Authenticate": "Bearer"})


async def air_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, AirError)
    p: _Pages = request.app.state.pages
    code = 404 if isinstance(exc, NotFoundError) else 400 if isinstance(exc, UserInputError) else 500
    user = None if p.auth_on else p.local_user
    return p.render(request, "error.html", user, status_code=code, message=exc.message, hint=exc.hint)


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
    if store is None or isinstance(store, RunStore):
        fixed = RunStore() if store is None else store
        open_store: Callable[[], RunStore] = lambda: fixed  # noqa: E731
    else:
        open_store = store
    pages = _Pages(open_store, authenticator, token_holder, mlflow_url, audit, access)
    routes = [Route("/", lambda request: RedirectResponse(f"{_base(request)}/runs", status_code=303)),
              Route("/runs", runs_page), Route("/runs/{run_id}", run_page), Route("/runs/{run_id}/logs/stream", log_stream),
              Route("/runs/{run_id}/cancel", cancel, methods=["POST"]), Route("/capacity", capacity_page),
              Route("/login", login, methods=["GET", "POST"]), Route("/logout", logout, methods=["POST"]),
              Mount("/static", StaticFiles(directory=HERE / "static"), name="static")]
    app = Starlette(routes=routes, exception_handlers={
        LoginRequired: login_required, AirError: air_error,
        Forbidden: lambda request, exc: HTMLResponse(f"<p>{escape(str(exc))}</p>", status_code=403)})
    if hosts is not None:  # before any page is read (its refusal still gets the headers below)
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(hosts))
    app.add_middleware(SecurityHeaders)
    app.state.pages = pages
    app.state.user_of = pages.user_of  # the server's MLflow door signs page users in the same way
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

