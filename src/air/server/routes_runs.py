"""`/api/v1/runs` and `/api/v1/blobs`: list, show, submit, cancel and follow runs; upload snapshot blobs.

Every answer is a view of `air.runs.views` (what the CLI's `--json` prints), so a remote CLI prints
from the same dicts as a local one. Any signed-in user may read any run; cancel needs its owner or an
admin (403 otherwise).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from air.constants import SERVER_MAX_UPLOAD_BYTES, STREAM_AUTH_RECHECK_S
from air.errors import AirError, NotFoundError, UserInputError
from air.runs.follow import FollowEvent, Lines, NewAttempt, follow, log_sources, snapshot_lines
from air.runs.states import RunStatus
from air.runs.states import statuses as parse_statuses
from air.runs.store import Run
from air.runs.views import attempt_index, log_files, queue_dict, run_detail, run_dict
from air.server.app import AuthError, Caller, error_body, pages_base, store_of, token_still_valid
from air.server.uploads import ServerPaths, check_digest, missing_blobs, store_blob

router = APIRouter()


class PayloadTooLarge(UserInputError):
    code = "PAYLOAD_TOO_LARGE"
    http_status = 413


def _paths(request: Request) -> ServerPaths:
    return request.app.state.paths


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


async def json_body(request: Request) -> Any:
    data = b"".join([chunk async for chunk in read_limited(request)])
    try:
        return json.loads(data or b"null")
    except ValueError as exc:
        raise UserInputError(f"The request body is not JSON: {exc}.") from None


# ---- runs -----------------------------------------------------------------------------------------


@router.get("/runs")
def list_runs(request: Request, who: Caller, all_users: bool = False,
              all_status: bool = False, status: Annotated[list[str] | None, Query()] = None, limit: int = 20,
              experiment: str | None = None, accelerator_type: str | None = None,
              num_accelerators: int | None = None) -> dict[str, Any]:
    store = store_of(request)
    if limit <= 0 or limit > 100_000:
        raise UserInputError(f"limit must be 1 to 100000, got {limit}.")
    wanted: Any = "all" if all_status else (parse_statuses(tuple(status)) if status else None)
    runs = store.list_runs(statuses=wanted, limit=limit, user=None if all_users else who.user,
                           experiment_glob=experiment, accelerator_type=accelerator_type,
                           num_accelerators=num_accelerators)
    return {"runs": [{**run_dict(r), "queue": queue_dict(store, r) if r.status is RunStatus.QUEUED else None}
                     for r in runs]}


@router.get("/pools")
def list_pools(request: Request, who: Caller) -> dict[str, Any]:
    from air.runs.views import pools_view

    return pools_view(store_of(request))


@router.get("/runs/{run_id}")
def get_run(request: Request, run_id: str) -> dict[str, Any]:
    store = store_of(request)
    return run_detail(store, store.get_run(run_id), pages_base=pages_base(request))


@router.post("/runs")
async def submit_run(request: Request, who: Caller) -> dict[str, Any]:
    from air.server.submission import submit_request

    body = await json_body(request)
    return await run_in_threadpool(submit_request, store_of(request), _paths(request), who, body)


@router.post("/runs/{run_id}/cancel")
def cancel_run(request: Request, run_id: str, who: Caller) -> dict[str, Any]:
    from air.runs.cancel import cancel_run as cancel
    from air.runs.cancel import may_cancel

    store = store_of(request)
    run = store.get_run(run_id)
    if not may_cancel(run.user, who.user, admin=who.admin):
        raise AuthError(f"Run {run.id} belongs to {run.user}; only its owner or an admin may cancel it.", status=403)
    return {"run_id": run.id, "status": cancel(store, run.id).value}


def _encode(item: FollowEvent) -> bytes:
    if isinstance(item, Run):
        data: dict[str, Any] = {"run": run_dict(item)}
    elif isinstance(item, Lines):
        data = {"lines": item.lines, "label": item.source.label, "index": item.source.index, "attempt": item.attempt}
    elif isinstance(item, NewAttempt):
        data = {"new_attempt": item.attempt, "previous": item.previous}
    return json.dumps(data).encode() + b"\n"


@router.get("/runs/{run_id}/follow")
def follow_run(request: Request, run_id: str, node: int | None = None, rank: int | None = None,
               attempt: int | None = None, tail: int | None = None, live: bool = True) -> StreamingResponse:
    """A run's events as NDJSON (`{"run": ...}`, `{"lines": [...], "label", "index", "attempt"}`,
    `{"new_attempt": N, "previous": M}`) until it ends; `live=0`: the last lines of each log, once.
    Problems found before streaming are plain 4xx answers."""
    from air.runs.views import log_masker

    store = store_of(request)
    run = store.get_run(run_id)
    for value, what in ((node, "node"), (rank, "rank"), (attempt, "attempt"), (tail, "tail")):
        if value is not None and value < 0:
            raise UserInputError(f"{what} must be 0 or more, got {value}.")
    mask = log_masker(run)
    if live:
        log_sources(run, run.current_attempt or 0, node=node, rank=rank)  # a wrong --node is a 4xx now
        events: Iterator[FollowEvent] = follow(run.id, store=store, node=node, rank=rank, attempt=attempt,
                                               tail=tail, mask=mask)
    else:
        index = attempt_index(store, run, attempt)
        first: list[FollowEvent] = [run, *snapshot_lines(run, index, node=node, rank=rank, tail=tail, mask=mask)]
        events = iter(first)

    stopping = getattr(request.app.state, "stopping", None)

    def body() -> Iterator[bytes]:
        checked = time.monotonic()
        try:
            for item in events:
                if stopping is not None and stopping.is_set():
                    return  # the server is stopping: the client reattaches to the next one
                if time.monotonic() - checked >= STREAM_AUTH_RECHECK_S:
                    if not token_still_valid(request):  # revoked while following: no more lines
                        revoked = AuthError("The token this stream was opened with is no longer valid "
                                            "(revoked).", status=401,
                                            hint="Ask an admin for a new one: air server token create NAME")
                        yield json.dumps(error_body(revoked)).encode() + b"\n"
                        return
                    checked = time.monotonic()
                yield _encode(item)
        except AirError as exc:  # after the answer began: the last line says what went wrong
            yield json.dumps(error_body(exc)).encode() + b"\n"

    return StreamingResponse(body(), media_type="application/x-ndjson")


def _attempt_of(request: Request, run: Run, attempt: int | None) -> int:
    if attempt is not None and attempt < 0:
        raise UserInputError(f"attempt must be 0 or more, got {attempt}.")
    return attempt_index(store_of(request), run, attempt)


@router.get("/runs/{run_id}/logs")
def list_logs(request: Request, run_id: str, attempt: int | None = None) -> dict[str, Any]:
    """The logs of one attempt (`air logs --download-to`): each one's label, index and size in bytes."""
    run = store_of(request).get_run(run_id)
    index = _attempt_of(request, run, attempt)
    logs = [{"label": f["label"], "index": f["index"], "bytes": f["path"].stat().st_size}
            for f in log_files(run, index) if f["exists"]]
    return {"run_id": run.id, "attempt": index, "logs": logs}


@router.get("/runs/{run_id}/logs/{label}/{index}")
def download_log(request: Request, run_id: str, label: str, index: int,
                 attempt: int | None = None) -> StreamingResponse:
    """One whole log as text, the run's secrets masked line by line (failing closed before any byte)."""
    from air.runs.views import log_masker

    run = store_of(request).get_run(run_id)
    number = _attempt_of(request, run, attempt)
    found = next((f for f in log_files(run, number) if (f["label"], f["index"]) == (label, index) and f["exists"]),
                 None)
    if found is None:
        raise NotFoundError(f"Run {run.id} has no log of {label} {index} in attempt {number}.")
    mask = log_masker(run)
    mask("")  # a secret that cannot be resolved refuses here, as a 4xx, not mid-file

    def body() -> Iterator[bytes]:
        with open(found["path"], encoding="utf-8", errors="replace", newline="") as log:
            for line in log:
                text, end = (line[:-1], "\n") if line.endswith("\n") else (line, "")
                yield (mask(text) + end).encode()

    return StreamingResponse(body(), media_type="text/plain; charset=utf-8")


# ---- blobs ----------------------------------------------------------------------------------------


@router.post("/blobs/missing")
async def blobs_missing(request: Request) -> dict[str, Any]:
    body = await json_body(request)
    digests = body.get("digests") if isinstance(body, dict) else None
    return {"missing": missing_blobs(_paths(request), digests if isinstance(digests, list) else None)}  # type: ignore[arg-type]


@router.put("/blobs/{digest}")
async def put_blob(request: Request, digest: str) -> dict[str, Any]:
    check_digest(digest)
    chunks = [chunk async for chunk in read_limited(request)]
    size = await run_in_threadpool(store_blob, _paths(request), digest, chunks)
    return {"digest": digest, "size": size}
