"""The door to MLflow: the air server serves its MLflow tracking server (on a Unix socket only the
server's account can reach, mlflow_server.py) under `/mlflow`, on its own port and behind its own TLS, to
callers with a valid token only.

Who may pass (401 without any):
- the server's own credential (its supervisors and call drivers: mlflow_server.server_credential):
  everything, as an admin;
- a run's credential (`MLFLOW_TRACKING_TOKEN` of its nodes, sent by MLflow's client as a bearer token):
  reads and writes of its own run's MLflow runs (every attempt's, and those it creates: the door tags
  each with the run and its owner), its own artifacts, experiment reads, and run searches filtered to its
  own runs; nothing else (another run's MLflow runs: 403, or 404 when its owner may not even see them);
- a user's API token, or the web session cookie (MLflow's UI pages): reads of the MLflow runs of the air
  runs the user may view (air.store.access, as the API), writes to those they manage, experiment reads,
  filtered searches, MLflow's UI files, and the GraphQL reads of MLflow's run pages once resolved as
  MLflow resolves them (air.server.mlflow_graphql: every run they reach is checked); every endpoint the
  door cannot scope to a run (model registry, traces, run creation, deletes of experiments...) is refused;
- an admin: everything.
Which air run an MLflow run belongs to, and the rule, are air.server.run_credentials'. Which route falls
under which rule is air.server.mlflow_routes' table: deny by default, a route it does not name is an admin's.

Bodies are streamed both ways (artifact uploads and downloads, UI files) with aiohttp, which MLflow's
full distribution (the `server` extra) brings: httpx is not installed. Only what the door must read to
decide is held in memory, bounded: JSON API request bodies (MAX_API_BODY) and run-search answers
(MAX_SEARCH_ANSWER).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import urllib.parse
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from air.server.mlflow_routes import Rule, api_op, artifacts_root, rule_of
from air.server.mlflow_server import MLFLOW_PREFIX
from air.server.run_credentials import (
    RUN_TAG,
    USER_TAG,
    DoorCaller,
    credential_caller,
    linked_air_run,
    may,
    protected_tag,
)
from air.server.tokens import verify_token
from air.store.access import Level, Policy
from air.store.run_store import RunStore

if TYPE_CHECKING:
    import aiohttp

    from air.web.auth import WebUser

#: Most bytes of a JSON API request the door reads to decide (MLflow's own log-batch limit is far below).
MAX_API_BODY = 16 * 1024 * 1024
#: The JSON names protobuf's parsing (MLflow's parse_dict) also takes for a run's id fields. The door
#: checks run_id/run_uuid/run_ids; MLflow reads `run_id or run_uuid`, so {"run_uuid": own, "runId": another}
#: would be checked as one run and act on the other: a body naming a run so is refused.
_RUN_ID_ALIASES = frozenset({"runId", "runUuid", "runIds"})
#: Most bytes of a run search's answer the door filters (MLflow pages searches; the UI asks for 100 runs).
MAX_SEARCH_ANSWER = 64 * 1024 * 1024
#: Read size of streamed bodies.
CHUNK = 64 * 1024
#: MLflow run id -> air run, remembered for this many MLflow runs (the link never changes).
_CACHE_SIZE = 10_000

#: The policy of MLflow's own UI at the door (the server's pages' policy would stop its inline styles and
#: scripts): still nothing from other sites, and framed only by this site (MLflow previews artifacts so).
MLFLOW_UI_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self' 'unsafe-inline' 'unsafe-eval'; "
    "style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:; font-src 'self' data:; connect-src 'self'; "
    "worker-src 'self' blob:; object-src 'none'; base-uri 'self'; frame-ancestors 'self'",
    "X-Frame-Options": "SAMEORIGIN",
}

_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                         "transfer-encoding", "upgrade", "host", "authorization", "cookie", "content-length"})



class Refused(Exception):
    """The door's answer instead of MLflow's: an HTTP status and MLflow's error shape."""

    CODES = {400: "INVALID_PARAMETER_VALUE", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED",
             404: "RESOURCE_DOES_NOT_EXIST", 413: "INVALID_PARAMETER_VALUE", 502: "TEMPORARILY_UNAVAILABLE",
             503: "TEMPORARILY_UNAVAILABLE"}

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": 'Bearer realm="air"'} if self.status == 401 else \
            {"Retry-After": "5"} if self.status == 503 else None
        return JSONResponse({"error_code": self.CODES.get(self.status, "PERMISSION_DENIED"), "message": self.message},
                            status_code=self.status, headers=headers)


class Door:
    """The `/mlflow` route of one server: who knocks, what they ask, forward or refuse."""

    #: The origin MLflow is asked at (over its Unix socket: the name only fills the Host header, which
    #: MLflow's DNS-rebinding check accepts).
    origin = "http://localhost"

    def __init__(self, app: FastAPI, socket_path: Path, public: str, server_credential: str = "") -> None:
        self.socket_path = socket_path
        self.public = public.rstrip("/")
        self.server_credential = server_credential
        self.app = app
        self._session: aiohttp.ClientSession | None = None
        self._owners: OrderedDict[str, str | None] = OrderedDict()

    # -- plumbing --------------------------------------------------------------------------------------
    @property
    def store(self) -> RunStore:
        return self.app.state.store

    def policy(self) -> Policy:
        """The server's rule: the same cached read of config.yaml the API and the pages use."""
        from air.server.visibility import current_policy

        return current_policy()

    def session(self) -> aiohttp.ClientSession:
        import aiohttp

        if self._session is None or self._session.closed:
            timeout = aiohttp.ClientTimeout(total=None, connect=30, sock_read=600)
            self._session = aiohttp.ClientSession(timeout=timeout, auto_decompress=False,
                                                  connector=aiohttp.UnixConnector(str(self.socket_path), limit=64))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- who knocks ------------------------------------------------------------------------------------
    def caller(self, request: Request) -> DoorCaller:
        """The caller, from the bearer token (a run credential or an API token) or the pages' session."""
        policy = self.policy()
        scheme, _, secret = request.headers.get("authorization", "").partition(" ")
        secret = secret.strip()
        if scheme.lower() == "bearer" and secret:
            if self.server_credential and hmac.compare_digest(secret.encode(), self.server_credential.encode()):
                return DoorCaller("air-server", admin=True)
            found = credential_caller(self.store, policy, secret)
            if found is not None:
                return found
            principal = verify_token(self.store, secret)
            if principal is not None:
                return DoorCaller(principal.user, principal.admin, policy.viewer(principal.user,
                                                                                 admin=principal.admin))
            raise Refused(401, "This token is not valid (unknown, revoked, or its run has ended).")
        user = self._page_user(request)
        if user is not None:
            if request.method.upper() not in ("GET", "HEAD") and not _same_origin(request):
                raise Refused(403, "A browser's MLflow request that changes or searches must come from this "
                              "server's own pages (no or another Origin).")
            return DoorCaller(user.name, user.admin, policy.viewer(user.name, admin=user.admin), session=True)
        raise Refused(401, "MLflow on air server needs a token: MLFLOW_TRACKING_TOKEN=<air token> (a run's nodes "
                      "get their run's), or log in to the server's pages first.")

    def _page_user(self, request: Request) -> WebUser | None:
        """The pages' signed-in user of this request (their session cookie), or None."""
        if not request.cookies:
            return None
        from air.server.deps import PAGES
        from air.web.auth import LoginRequired

        for route in self.app.routes:
            user_of = getattr(getattr(getattr(route, "app", None), "state", None), "user_of", None)
            if getattr(route, "path", None) == PAGES and callable(user_of):
                try:
                    return user_of(request)
                except LoginRequired:
                    return None
        return None

    def air_run_of(self, mlflow_run_id: str) -> str | None:
        """The air run an MLflow run belongs to: the store's link (else `owner` reads its `air.run_id`
        tag from MLflow)."""
        if mlflow_run_id in self._owners:
            return self._owners[mlflow_run_id]
        return linked_air_run(self.store, mlflow_run_id)

    def _remember(self, mlflow_run_id: str, air_run: str | None) -> None:
        if air_run is None:
            return  # not cached: it may be linked a moment later (a run being created)
        self._owners[mlflow_run_id] = air_run
        while len(self._owners) > _CACHE_SIZE:
            self._owners.popitem(last=False)

    async def owner(self, mlflow_run_id: str) -> str | None:
        air_run = await run_in_threadpool(self.air_run_of, mlflow_run_id)
        if air_run is None and mlflow_run_id:
            tags = await self._tags_of(mlflow_run_id)
            air_run = tags.get(RUN_TAG)
        self._remember(mlflow_run_id, air_run)
        return air_run

    async def _tags_of(self, mlflow_run_id: str) -> dict[str, str]:
        url = f"{self.origin}{MLFLOW_PREFIX}/api/2.0/mlflow/runs/get?" + urllib.parse.urlencode({"run_id": mlflow_run_id})
        async with self.session().get(url, headers={"Accept-Encoding": "identity"}) as answer:
            if answer.status != 200:
                return {}
            data = json.loads(await answer.content.read(MAX_API_BODY))
        return {t["key"]: t["value"] for t in data.get("run", {}).get("data", {}).get("tags", []) if "key" in t}

    async def check_runs(self, caller: DoorCaller, mlflow_run_ids: Iterable[str], need: Level) -> None:
        ids = [i for i in dict.fromkeys(mlflow_run_ids) if i]
        if not ids and not caller.admin:
            raise Refused(400, "Name the MLflow run (run_id).")
        for mlflow_run_id in ids:
            status = await run_in_threadpool(may, self.store, self.policy(), caller, await self.owner(mlflow_run_id),
                                             need)
            if status == 404:
                raise Refused(404, f"Run '{mlflow_run_id}' not found.")
            if status is not None:
                raise Refused(403, f"{caller.label} may not {'write to' if need > Level.CAN_VIEW else 'read'} "
                              f"MLflow run {mlflow_run_id}.")

    def _check_started(self) -> None:
        """503 while the server's MLflow starts beside it (air.server.mlflow_server.MLflowState), or failed."""
        state = getattr(self.app.state, "mlflow_state", None)
        if state is None or state.state == "ready":
            return
        if state.state == "starting":
            raise Refused(503, f"MLflow is starting beside the air server ({state.waited_s():.0f} s so far); "
                          "try again in a few seconds (GET /api/v1/health says when it is ready).")
        raise Refused(503, f"The air server's MLflow is not running: {state.message or state.state} "
                      "Its administrator can read why in the server's log and restart the server.")

    # -- what they ask ---------------------------------------------------------------------------------
    async def handle(self, request: Request) -> Response:
        import aiohttp

        try:
            caller = await run_in_threadpool(self.caller, request)
            self._check_started()
            return await self._route(request, caller)
        except Refused as refused:
            return refused.response()
        except aiohttp.ClientError as exc:
            return Refused(502, f"air server could not reach its MLflow server: {exc}").response()

    async def _route(self, request: Request, caller: DoorCaller) -> Response:
        path = request.url.path[len(MLFLOW_PREFIX):]
        segments = path.split("/")[1:]
        if any(part in (".", "..") for part in segments) or "//" in path or "\\" in path or "%" in path:
            raise Refused(400, "Malformed path (no '.', '..', '//', '\\' or escapes after decoding).")
        method = request.method.upper()
        query = request.query_params
        if caller.admin:
            return await self.forward(request)
        rule = rule_of(method, path)  # the door's whole table: a route it does not name is an admin's
        if rule in (Rule.RUN_READ, Rule.RUN_WRITE, Rule.RUN_CREATE, Rule.RUN_SEARCH):
            return await self._api(request, caller, rule, method)
        if rule is Rule.RUN_ARTIFACT:  # every value (a repeated key: MLflow reads the first, Starlette the last)
            await self.check_runs(caller, [*query.getlist("run_uuid"), *query.getlist("run_id")] or [""],
                                  Level.CAN_VIEW)
            return await self.forward(request)
        artifacts = artifacts_root(path)
        if rule is Rule.PROXIED_ARTIFACT and artifacts is not None:
            listed = query.getlist("path")
            if len(listed) > 1:
                raise Refused(400, "Give one artifact path.")
            rel = path[len(artifacts):].lstrip("/") or (listed[0] if listed else "")
            need = Level.CAN_VIEW if method in ("GET", "HEAD") else Level.CAN_MANAGE
            await self.check_runs(caller, [_artifact_run(rel)], need)
            return await self.forward(request)
        if rule is Rule.GRAPHQL:  # MLflow's UI reads a run's page so
            body = await _json_body(request)
            runs = await self._graphql_runs(body)
            if runs:  # (none: an experiment's read, or only `__typename`)
                await self.check_runs(caller, runs, Level.CAN_VIEW)
            return await self.forward(request, body=_encode(body))
        if rule is Rule.EXPERIMENT_READ or (rule is Rule.UI and caller.credential is None):
            return await self.forward(request)
        raise Refused(403, f"{caller.label} may not use MLflow's {method} {path or '/'} through air server "
                      "(only an admin may).")

    async def _graphql_runs(self, body: Mapping[str, object]) -> list[str]:
        """The MLflow runs a GraphQL request reads once resolved as MLflow resolves it (mlflow_graphql)."""
        from air.server.mlflow_graphql import GraphQLRefused, graphql_runs, mlflow_schema

        try:
            schema = await run_in_threadpool(mlflow_schema)
            return await run_in_threadpool(graphql_runs, schema, body)
        except GraphQLRefused as refused:
            raise Refused(refused.status, refused.message) from None

    async def _api(self, request: Request, caller: DoorCaller, rule: Rule, method: str) -> Response:
        query = request.query_params
        if rule is Rule.RUN_READ:
            if method in ("GET", "HEAD"):
                ids = [*query.getlist("run_id"), *query.getlist("run_uuid"), *query.getlist("run_ids")]
                await self.check_runs(caller, ids, Level.CAN_VIEW)
                return await self.forward(request)
            body = await _json_body(request)
            ids = [body.get("run_id") or "", body.get("run_uuid") or "", *_strings(body.get("run_ids"))]
            await self.check_runs(caller, [str(i) for i in ids], Level.CAN_VIEW)
            return await self.forward(request, body=_encode(body))
        if rule is Rule.RUN_WRITE:
            body = await _json_body(request)
            await self.check_runs(caller, [str(body.get("run_id") or ""), str(body.get("run_uuid") or "")],
                                  Level.CAN_MANAGE)
            keys = [str(t.get("key")) for t in _tag_list(body)]
            if api_op(request.url.path[len(MLFLOW_PREFIX):]) in ("runs/set-tag", "runs/delete-tag"):
                keys.append(str(body.get("key")))
            bad = [k for k in keys if protected_tag(k)]
            if bad:
                raise Refused(403, f"Tag {bad[0]!r} is air's: only air sets it.")
            return await self.forward(request, body=_encode(body))
        if rule is Rule.RUN_CREATE and caller.credential is not None:
            body = await _json_body(request)
            run = caller.credential.run_id
            tags = [t for t in _tag_list(body) if not protected_tag(str(t.get("key")))]
            body["tags"] = [*tags, {"key": RUN_TAG, "value": run}, {"key": USER_TAG, "value": caller.user}]
            body["user_id"] = caller.user
            parent = next((str(t.get("value")) for t in tags if t.get("key") == "mlflow.parentRunId"), None)
            if parent:
                await self.check_runs(caller, [parent], Level.CAN_MANAGE)
            return await self.forward(request, body=_encode(body))
        if rule is Rule.RUN_SEARCH:
            return await self._search(request, caller, await _json_body(request))
        raise Refused(403, f"{caller.label} may not call MLflow's {request.url.path[len(MLFLOW_PREFIX):]} through "
                      "air server (only an admin may).")

    async def _search(self, request: Request, caller: DoorCaller, body: Mapping[str, object]) -> Response:
        """A run search, its answer narrowed to the runs the caller may read (a credential: its own)."""
        async with self.session().request("POST", self._url(request), data=_encode(body),
                                          headers={**_forwarded(request), "Accept-Encoding": "identity",
                                                   "Content-Type": "application/json"}) as answer:
            raw = await answer.content.read(MAX_SEARCH_ANSWER + 1)
            if len(raw) > MAX_SEARCH_ANSWER:
                raise Refused(413, "The search's answer is too large: ask for fewer runs (max_results).")
            if answer.status != 200:
                return Response(raw, status_code=answer.status, media_type=answer.headers.get("Content-Type"))
        data = json.loads(raw or b"{}")
        kept = []
        for run in data.get("runs") or []:
            info = run.get("info") or {}
            mlflow_run_id = str(info.get("run_id") or info.get("run_uuid") or "")
            tags = {t.get("key"): t.get("value") for t in (run.get("data") or {}).get("tags") or []}
            air_run = await run_in_threadpool(self.air_run_of, mlflow_run_id) or tags.get(RUN_TAG)
            self._remember(mlflow_run_id, air_run)
            if await run_in_threadpool(may, self.store, self.policy(), caller, air_run, Level.CAN_VIEW) is None:
                kept.append(run)
        data["runs"] = kept
        return JSONResponse(data)

    # -- forward ---------------------------------------------------------------------------------------
    def _url(self, request: Request) -> str:
        query = request.url.query
        return f"{self.origin}{request.url.path}" + (f"?{query}" if query else "")

    async def forward(self, request: Request, body: bytes | None = None) -> Response:
        """Send the request on to MLflow and stream its answer back (bodies never held whole)."""
        data: bytes | AsyncIterator[bytes] | None = body if body is not None else (
            _stream(request) if _has_body(request) else None)
        headers = _forwarded(request)
        if body is not None:
            headers["Content-Type"] = "application/json"
        elif data is not None and request.headers.get("content-length"):
            headers["Content-Length"] = request.headers["content-length"]  # sent as is, not chunked
        import aiohttp

        try:
            answer = await self.session().request(request.method, self._url(request), data=data, headers=headers,
                                                  allow_redirects=False)
        except aiohttp.ClientError as exc:
            raise Refused(502, f"air server could not reach its MLflow server: {exc}") from None
        out = {k: v for k, v in answer.headers.items() if k.lower() not in _HOP_BY_HOP}
        if answer.headers.get("Content-Length"):
            out["Content-Length"] = answer.headers["Content-Length"]
        present = {k.lower() for k in out}
        out.update({k: v for k, v in MLFLOW_UI_HEADERS.items() if k.lower() not in present})
        if "Location" in out and out["Location"].startswith(self.origin):
            out["Location"] = str(request.base_url).rstrip("/") + out["Location"][len(self.origin):]

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in answer.content.iter_chunked(CHUNK):
                    yield chunk
            finally:
                answer.release()

        return StreamingResponse(relay(), status_code=answer.status, headers=out)


def _same_origin(request: Request) -> bool:
    """Whether a browser's request says it comes from this server (Origin, else Referer; absent: no)."""
    origin = request.headers.get("origin") or request.headers.get("referer") or ""
    parts = urllib.parse.urlsplit(origin)
    return bool(parts.netloc) and parts.netloc == request.url.netloc and parts.scheme == request.url.scheme


def _forwarded(request: Request) -> dict[str, str]:
    """The request's headers as MLflow gets them: no air token, no air cookie, no hop-by-hop header."""
    return {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}


def _has_body(request: Request) -> bool:
    return request.method.upper() not in ("GET", "HEAD", "DELETE", "OPTIONS") or bool(
        request.headers.get("content-length", "0") not in ("", "0"))


async def _stream(request: Request) -> AsyncIterator[bytes]:
    async for chunk in request.stream():
        if chunk:
            yield chunk


async def _json_body(request: Request) -> dict[str, Any]:  # Any: MLflow's bodies, read loosely (see _api)
    """The JSON object of an API request, read up to MAX_API_BODY (the door must see what it decides on)."""
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_API_BODY:
            raise Refused(413, f"The request body is over {MAX_API_BODY // (1024 * 1024)} MiB.")
    if not raw:
        return {}
    try:
        body = json.loads(bytes(raw))
    except ValueError:
        raise Refused(400, "The request body is not JSON.") from None
    if not isinstance(body, dict):
        raise Refused(400, "The request body must be a JSON object.")
    aliases = sorted(_RUN_ID_ALIASES.intersection(body))
    if aliases:
        raise Refused(400, f"Name the MLflow run as run_id (or run_uuid, run_ids), not {aliases[0]!r}.")
    return body


def _encode(body: Mapping[str, object]) -> bytes:
    return json.dumps(body).encode()


def _tag_list(body: Mapping[str, object]) -> list[dict[str, object]]:
    """A request's `tags`: MLflow's list of {key, value} objects (its other entries are MLflow's to refuse);
    400 for anything but a list, which MLflow would answer with a server error."""
    tags = body.get("tags")
    if tags is None:
        return []
    if not isinstance(tags, list):
        raise Refused(400, "`tags` must be a list of {\"key\": ..., \"value\": ...} objects.")
    return [t for t in tags if isinstance(t, dict)]


def _strings(value: object) -> list[str]:
    return [str(v) for v in value] if isinstance(value, list) else [str(value)] if value else []


def _artifact_run(rel: str) -> str:
    """The MLflow run of a proxied artifact path `<experiment>/<run>/artifacts/...` ('' when none, or
    when the path is not plain: MLflow must get exactly the path checked here)."""
    parts = rel.strip("/").split("/")
    if any(part in ("", ".", "..") or "%" in part or "\\" in part for part in parts):
        return ""
    return parts[1] if len(parts) >= 3 and parts[2] == "artifacts" else ""


def mount_door(app: FastAPI, socket_path: Path, *, public: str, server_credential: str = "") -> Door:
    """Serve MLflow (listening on the Unix socket `socket_path`) under `/mlflow` on `app`; `public` is the
    door's address as nodes and pages use it; `server_credential` lets the server's supervisors in."""
    door = Door(app, socket_path, public, server_credential)
    methods = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]

    async def handle(request: Request) -> Response:
        return await door.handle(request)

    app.add_api_route(MLFLOW_PREFIX, handle, methods=methods, include_in_schema=False)
    app.add_api_route(MLFLOW_PREFIX + "/{rest:path}", handle, methods=methods, include_in_schema=False)
    app.state.mlflow_uri = door.public  # the pages' MLflow link: the door
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(application: FastAPI) -> AsyncIterator[Any]:  # Any: what the inner lifespan yields
        async with inner(application) as state:
            try:
                yield state
            finally:
                await asyncio.shield(door.close())

    app.router.lifespan_context = lifespan
    return door

