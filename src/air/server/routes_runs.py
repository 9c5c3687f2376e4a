"""`/api/v1/runs` and `/api/v1/blobs`: list, show, submit, cancel and follow runs; upload snapshot blobs.

Every answer is a view of `air.views.query` (what the CLI's `--json` prints) as its air.wire model, so
a remote CLI prints the same fields as a local one. Who may read or cancel a run is air.server.visibility's
rule (the server's `default_visibility`, the run's `permissions`): a run one may not view is 404 on every
route, cancel needs CAN_MANAGE_RUN (403 for one who may only view it).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from air.bounds import MAX_QUERY_INT
from air.config import load_config
from air.constants import STREAM_AUTH_RECHECK_S
from air.errors import AirError, NotFoundError, UserInputError
from air.runs.cancel import cancel_run as cancel
from air.runs.cancel import canceled_by
from air.server.audit import RUN_CANCEL, record
from air.server.deps import (
    AuthError,
    Caller,
    PayloadTooLarge,
    error_body,
    json_body,
    pages_base,
    parse_request,
    read_limited,
    store_of,
    token_still_valid,
)
from air.server.fanout import hub_of, take_ndjson
from air.server.submission import submit_request
from air.server.uploads import (
    BlobQuota,
    BlobQuotaExceeded,
    ServerPaths,
    check_digest,
    missing_blobs,
    receive_blob,
)
from air.server.visibility import change_permissions, current_policy, readable_run, run_visible, viewer_for
from air.store.access import Level
from air.store.states import RunStatus
from air.store.states import statuses as parse_statuses
from air.views.fanout import reader_following
from air.views.follow import log_sources, snapshot
from air.views.query import (
    event_from,
    log_list,
    log_masker,
    masked_log,
    pools_view,
    run_detail,
    run_summary,
    written_logs,
)
from air.wire import (
    BlobAnswer,
    BlobsMissingAnswer,
    BlobsMissingRequest,
    CancelAnswer,
    DryRunAnswer,
    LogList,
    PermissionsAnswer,
    PoolList,
    RunDetail,
    RunList,
    SubmitAnswer,
    encode_event,
)

router = APIRouter()

#: How often a follower that gets no events looks at the server stopping and its rights.
STREAM_CHECK_S = 0.5


def _paths(request: Request) -> ServerPaths:
    return request.app.state.paths


#: An integer query parameter that reaches SQLite: bounded, so a 30-digit one is a 400, not an overflow.
QueryInt = Annotated[int, Query(le=MAX_QUERY_INT, ge=-MAX_QUERY_INT)]
OptionalQueryInt = Annotated[int | None, Query(le=MAX_QUERY_INT, ge=-MAX_QUERY_INT)]
#: A node, rank or attempt index, a line count or minutes: 0 or more (a 400 that says so otherwise).
IndexQuery = Annotated[int | None, Query(le=MAX_QUERY_INT, ge=0)]


# ---- runs -----------------------------------------------------------------------------------------


@router.get("/runs", response_model_exclude_unset=True)
def list_runs(request: Request, who: Caller, all_users: bool = False,
              all_status: bool = False, status: Annotated[list[str] | None, Query()] = None, limit: QueryInt = 20,
              experiment: str | None = None, accelerator_type: str | None = None,
              num_accelerators: OptionalQueryInt = None, user: str | None = None) -> RunList:
    """`user`: that user's runs (those the caller may see), whatever `all_users` says."""
    store = store_of(request)
    if limit <= 0 or limit > 100_000:
        raise UserInputError(f"limit must be 1 to 100000, got {limit}.")
    wanted: frozenset[RunStatus] | Literal["all"] | None = (
        "all" if all_status else (parse_statuses(tuple(status)) if status else None))
    policy = current_policy()
    viewer = viewer_for(who, policy)
    runs = store.list_runs(statuses=wanted, limit=limit, user=user or (None if all_users else who.user),
                           experiment_glob=experiment, accelerator_type=accelerator_type,
                           num_accelerators=num_accelerators, visible_to=policy.list_filter(viewer))
    runs = [r for r in runs if policy.allows(viewer, r)]  # the SQL filter's reading, checked by the rule itself
    return RunList.model_validate({"runs": [run_summary(store, r) for r in runs]})


@router.get("/pools", response_model_exclude_unset=True)
def list_pools(request: Request, who: Caller) -> PoolList:
    store = store_of(request)
    data = PoolList.model_validate(pools_view(store))
    policy = current_policy()
    viewer = viewer_for(who, policy)
    if policy.list_filter(viewer) is not None:  # `private`: the runs holding a pool's slots, if one may see them

        def sees(run_id: str) -> bool:
            try:
                return policy.allows(viewer, store.get_run(run_id))
            except NotFoundError:
                return False

        for pool in data.pools:
            pool.runs = [r for r in pool.runs if sees(r)]
    return data


@router.get("/runs/{run_id}", response_model_exclude_unset=True)
def get_run(request: Request, run_id: str, who: Caller) -> RunDetail:
    store = store_of(request)
    return RunDetail.model_validate(run_detail(store, readable_run(store, run_id, who), pages_base=pages_base(request)))


@router.post("/runs")
async def submit_run(request: Request, who: Caller) -> SubmitAnswer | DryRunAnswer:
    body = await json_body(request)
    return await run_in_threadpool(submit_request, store_of(request), _paths(request), who, body,
                                   critical_users=getattr(request.app.state, "critical_users", frozenset()))


@router.put("/runs/{run_id}/permissions")
async def put_permissions(request: Request, run_id: str, who: Caller) -> PermissionsAnswer:
    """Replace who else may see or act on the run (the workload's `permissions` form); CAN_MANAGE only."""
    body = await json_body(request)
    run = await run_in_threadpool(change_permissions, store_of(request), run_id, who, body)
    return PermissionsAnswer(run_id=run.id, permissions=json.loads(run.permissions or "[]"))


@router.post("/runs/{run_id}/cancel")
def cancel_run(request: Request, run_id: str, who: Caller) -> CancelAnswer:
    store = store_of(request)
    run = readable_run(store, run_id, who)
    if not run_visible(run, who, need=Level.CAN_MANAGE_RUN):
        raise AuthError(f"Run {run.id} belongs to {run.user}; only its owner, an admin or a CAN_MANAGE_RUN "
                        "grant in its permissions may cancel it.", status=403)
    reason = canceled_by(who.user, admin=who.admin, owner=run.user)
    if not run.is_terminal:
        record(store, who.user, RUN_CANCEL, run.id, {"owner": run.user, "via": "api", "reason": reason})
    return CancelAnswer(run_id=run.id, status=cancel(store, run.id, reason=reason))


@router.get("/runs/{run_id}/follow")
def follow_run(request: Request, run_id: str, who: Caller, node: IndexQuery = None, rank: IndexQuery = None,
               attempt: IndexQuery = None, tail: IndexQuery = None, live: bool = True,
               minutes: IndexQuery = None) -> StreamingResponse:
    """A run's events as NDJSON (`{"run": ...}`, `{"lines": [...], "label", "index", "attempt"}`,
    `{"new_attempt": N, "previous": M}`) until it ends; `live=0`: the last lines of each log, once.
    Problems found before streaming are plain 4xx answers."""
    store = store_of(request)
    run = readable_run(store, run_id, who)
    since = None if minutes is None else time.time() - minutes * 60  # the clock of the machine with the logs
    mask = log_masker(run)
    stopping = getattr(request.app.state, "stopping", None)
    if not live:
        first = snapshot(store, run, attempt, node=node, rank=rank, tail=tail, mask=mask, since=since)
        return StreamingResponse((encode_event(event_from(item, store)) for item in first),
                                 media_type="application/x-ndjson")
    log_sources(run, run.current_attempt or 0, node=node, rank=rank)  # a wrong --node is a 4xx now

    def still_allowed() -> bytes | None:
        """None while the caller may still follow; else the stream's last line saying why not."""
        if not token_still_valid(request):  # revoked while following: no more lines
            revoked = AuthError("The token this stream was opened with is no longer valid (revoked).", status=401,
                                hint="Ask an admin for a new one: air server token create NAME")
            return encode_event(error_body(revoked))
        try:
            readable_run(store, run.id, who)  # a grant taken back while following: a 404 line, no more
        except AirError as exc:
            return encode_event(error_body(exc))
        return None

    async def body() -> AsyncIterator[bytes]:
        """The follower's share of the run's one reader (air.server.fanout), with the caller's rights
        checked again every STREAM_AUTH_RECHECK_S."""
        hub = hub_of(request.app)
        follower = hub.follow((run.id, node, rank, attempt),
                              reader_following(run.id, store, node=node, rank=rank, attempt=attempt, mask=mask),
                              tail=tail, since=since)
        checked = time.monotonic()
        try:
            while True:
                chunk = await take_ndjson(follower, STREAM_CHECK_S)
                if stopping is not None and stopping.is_set():
                    return  # the server is stopping: the client reattaches to the next one
                if time.monotonic() - checked >= STREAM_AUTH_RECHECK_S:
                    refused = await hub.recheck((request.headers.get("authorization"), run.id), still_allowed,
                                                STREAM_AUTH_RECHECK_S)
                    if refused is not None:
                        yield refused
                        return
                    checked = time.monotonic()
                if chunk is None:
                    return
                if chunk:
                    yield chunk
        finally:
            hub.leave(follower)

    return StreamingResponse(body(), media_type="application/x-ndjson", headers={"X-Accel-Buffering": "no"})


@router.get("/runs/{run_id}/logs")
def list_logs(request: Request, run_id: str, who: Caller, attempt: IndexQuery = None) -> LogList:
    """The logs of one attempt (`air logs --download-to`): each one's label, index and size in bytes."""
    store = store_of(request)
    return log_list(store, readable_run(store, run_id, who), attempt)


@router.get("/runs/{run_id}/logs/{label}/{index}")
def download_log(request: Request, run_id: str, label: str, index: int, who: Caller,
                 attempt: IndexQuery = None) -> StreamingResponse:
    """One whole log as text, the run's secrets masked line by line (failing closed before any byte)."""
    store = store_of(request)
    run = readable_run(store, run_id, who)
    number, written = written_logs(store, run, attempt)
    found = next((s.path for s in written if (s.label, s.index) == (label, index)), None)
    if found is None:
        raise NotFoundError(f"Run {run.id} has no log of {label} {index} in attempt {number}.")
    mask = log_masker(run)
    mask("")  # a secret that cannot be resolved refuses here, as a 4xx, not mid-file
    return StreamingResponse((line.encode(errors="surrogateescape") for line in masked_log(found, mask)),
                             media_type="text/plain; charset=utf-8")


# ---- blobs ----------------------------------------------------------------------------------------


@router.post("/blobs/missing")
async def blobs_missing(request: Request) -> BlobsMissingAnswer:
    asked = parse_request(BlobsMissingRequest, await json_body(request), "blob question")
    return BlobsMissingAnswer(missing=missing_blobs(_paths(request), asked.digests))


@router.put("/blobs/{digest}")
async def put_blob(request: Request, digest: str, who: Caller) -> BlobAnswer:
    check_digest(digest)
    declared = request.headers.get("content-length")
    quota = BlobQuota(_paths(request), who.user, (await run_in_threadpool(load_config)).server.limits.blob_quota_per_user)
    body = read_limited(request)
    try:
        size = await receive_blob(_paths(request), digest, body,  # streamed to disk as it comes
                                  quota=quota, declared=int(declared) if declared and declared.isdigit() else None)
    except BlobQuotaExceeded:
        # Read (and drop) the rest of the body, within the upload limit, before answering: a server that answers
        # and closes while the client still sends cuts the connection (EPIPE) before the client reads the 413.
        with contextlib.suppress(PayloadTooLarge):
            async for _ in body:
                pass
        raise
    return BlobAnswer(digest=digest, size=size)
