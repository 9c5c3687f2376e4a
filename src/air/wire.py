"""The client contract of `air server`, as data: request bodies, answers and follow-stream events.

One module for every side of the wire, below the views: pure data, so the views and the server build
these models (air.views.query.event_from, the routes' answers: FastAPI serializes them and the OpenAPI
schema describes each), the server parses request bodies with them (air.server.deps.parse_request), the
CLI, `@distributed(remote=True)` and the SDK (`air.Client`) read them, and `decode_event` is the one
reader of a follow stream's lines. `API_VERSION` is what this air speaks; the
server states it in `GET /api/v1/health` and in the `X-Air-Api-Version` header of every answer, and the
client refuses a server that states another (air.client.http).

Bounds: a body reaches these models only after `air.bounds.json_loads_bounded` (size, depth, 64-bit
integers); numeric limits here are air.bounds' (`MAX_RETRIES`, `MAX_NUM_ACCELERATORS`).
"""

from __future__ import annotations

import datetime as _dt
import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel, field_serializer

from air.bounds import MAX_NUM_ACCELERATORS, MAX_RETRIES
from air.store.states import AttemptStatus, FailureClass, RunStatus

#: The version of the API this air speaks (the `/api/v1` routes and these models). Raised when a route or
#: a model changes in a way an older client cannot read.
API_VERSION = 1
#: The answer header that carries the server's API version.
API_VERSION_HEADER = "X-Air-Api-Version"


# Every model defers building its validator to its first use (defer_build): an `air` command uses two or
# three of them, and building all of them at import was ~30 ms of every command's CPU.


class _Request(BaseModel):
    """A request body: unknown fields are an error (a typo is not silently dropped)."""

    model_config = ConfigDict(extra="forbid", defer_build=True)


class _Answer(BaseModel):
    """An answer: fields a newer server adds are kept, not refused."""

    model_config = ConfigDict(extra="allow", defer_build=True)


# ---- requests ---------------------------------------------------------------------------------------


class SnapshotFile(_Request):
    """One entry of a code snapshot: a file (by its content's sha256) or a symbolic link (its target)."""

    path: str
    mode: str
    sha256: str | None = None
    target: str | None = None


class SnapshotManifest(_Request):
    """The code snapshot a submit names: its blobs are uploaded before (`PUT /blobs/{sha256}`)."""

    name: str
    files: list[SnapshotFile]


class WorkloadFields(RootModel[dict[str, Any]]):
    """A workload's fields as its YAML holds them (air.workload.spec.WorkloadSpec's); the server validates
    them as `air run` validates YAML, against the run's code snapshot, which only it has."""


class SubmitRequest(_Request):
    """`POST /runs`: a workload and its snapshot."""

    spec: WorkloadFields
    snapshot: SnapshotManifest | None = None
    idempotency_key: Annotated[str, Field(min_length=1, max_length=64, pattern=r"\S")] | None = None
    dry_run: bool = False
    #: The submitter's DATABRICKS_USE_RESERVED_GPU_POOL (None: not set).
    use_reserved_pool: bool | None = None


class CallRequest(_Request):
    """`POST /calls`: a pickled `@distributed(remote=True)` call and its shape."""

    payload_b64: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(max_length=200)] = "fn"
    num_accelerators: Annotated[int, Field(gt=0, le=MAX_NUM_ACCELERATORS)]
    accelerator_type: Annotated[str, Field(min_length=1, max_length=200)]
    timeout: Annotated[float, Field(gt=0)] | None = None
    hang_timeout: Annotated[float, Field(gt=0)] | None = None
    max_retries: Annotated[int, Field(ge=0, le=MAX_RETRIES)] = 0
    preload: list[Annotated[str, Field(max_length=200)]] = []
    experiment: Annotated[str, Field(min_length=1, max_length=200)] = "air-distributed"
    use_reserved_pool: bool | None = None
    pool: str | None = None


class BlobsMissingRequest(_Request):
    """`POST /blobs/missing`: which of these sha256 digests the server lacks."""

    digests: list[str]


# ---- answers ----------------------------------------------------------------------------------------


def _rfc3339(value: _dt.datetime | None) -> str | None:
    if value is None:
        return None
    return value.astimezone(_dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class Run(_Answer):
    """A run as the API, `air get run --json` and `air.Client` show it (the hosted product's field names).

    `get` answers carry more (`mlflow_url`, `page_url`, `attempt_list`, `queue`, ...): they are kept as
    extra fields (`run.model_extra`)."""

    run_id: str
    status: RunStatus
    experiment_name: str
    run_name: str | None = None
    #: "workload" (a YAML) or "call" (a `@distributed` call).
    kind: str = "workload"
    user: str = ""
    accelerator_type: str
    num_accelerators: int
    num_nodes: int
    #: 0-based index of the latest attempt (what `air logs --retry` takes); None before the first.
    attempt_number: int | None = None
    #: How many attempts the run has made.
    attempts: int = 0
    profile: str | None = None
    termination_reason: str | None = None
    failure_class: FailureClass | None = None
    submitted_at: _dt.datetime | None = None
    started_at: _dt.datetime | None = None
    ended_at: _dt.datetime | None = None
    duration_seconds: float | None = None
    mlflow_run_id: str | None = None
    mlflow_url: str | None = None
    page_url: str | None = None
    pool: str | None = None
    backend: str = "local"
    #: `compute.priority_class`: BEST_EFFORT, NORMAL or CRITICAL (orders its pool's queue).
    priority_class: str = "NORMAL"
    #: Attempts after the first that a failure caused (preempted attempts are not retries).
    retries: int = 0
    #: Attempts of it that a CRITICAL run preempted.
    preemptions: int = 0
    #: Why a QUEUED run waits (position, slots, holders, `reason`); None when it does not wait.
    queue: dict[str, Any] | None = None
    #: What a RUNNING run's nodes wait for before they start (its MLflow run), and for how long; else None.
    waiting: str | None = None
    #: A `for_each` sweep's parent run (its children are ordinary runs).
    is_sweep: bool = False

    @field_serializer("submitted_at", "started_at", "ended_at")
    def _times(self, value: _dt.datetime | None) -> str | None:
        return _rfc3339(value)

    @property
    def id(self) -> str:
        """`run_id`, as a store's run names it (air.views.follow.log_sources reads either)."""
        return self.run_id

    @property
    def is_terminal(self) -> bool:
        """Whether the run has ended (it changes no more)."""
        return self.status.is_terminal()

    @property
    def ok(self) -> bool:
        return self.status is RunStatus.SUCCESS


class Attempt(_Answer):
    """One attempt of a run, as `air get run` lists it (`attempt_list`; times in epoch seconds)."""

    index: int
    status: AttemptStatus
    started_at: float
    ended_at: float | None = None
    termination_reason: str | None = None
    failure_class: FailureClass | None = None
    mlflow_run_id: str | None = None

    def duration_seconds(self) -> float:
        """Its length so far (to now while it runs)."""
        import time

        return max(0.0, (self.ended_at if self.ended_at is not None else time.time()) - self.started_at)


class RankLog(_Answer):
    """Where a call's rank log is (`air logs ID --rank N` reads it) and whether it is written yet."""

    rank: int
    path: str
    exists: bool


class LogFile(_Answer):
    """One log an attempt has written: `label` "node" (or "rank": a local call's), its index, its size."""

    label: str
    index: int
    bytes: int


class LogList(_Answer):
    """`GET /runs/{id}/logs`: the logs of one attempt that exist (`air logs --download-to` copies them)."""

    run_id: str
    attempt: int
    logs: list[LogFile]


class RunDetail(Run):
    """`GET /runs/{id}`, `air get run` and `air.Client.get`: the run with its attempts, folder, how quiet
    its nodes are, its checkpoints and (a call) its rank logs (air.views.query.run_detail makes it)."""

    attempt_list: list[Attempt] = []
    folder: str | None = None
    #: Each node process of the current attempt and how long it has been quiet (views.progress_view).
    progress: list[dict[str, Any]] = []
    node_ended: str | None = None
    checkpoint_dir: str | None = None
    latest_checkpoint: str | None = None
    rank_logs: list[RankLog] = []
    #: A sweep's counts (total, completed, succeeded, failed, active, pending), max_concurrent and `tasks`
    #: (index, parameters, run_id, status, times); None for any other run (air.runs.sweep.sweep_view).
    sweep: dict[str, object] | None = None
    #: A sweep child's parent: {"run_id", "index"}; None for any other run.
    sweep_parent: dict[str, object] | None = None
    #: The run ended and its supervisor is still recording its MLflow run (its id, logs, status): a reader
    #: that needs `mlflow_run_id` of an ended run waits until this is False (views.mlflow_recording).
    mlflow_recording: bool = False


class RunList(_Answer):
    """`GET /runs`."""

    runs: list[Run]


class SubmitAnswer(_Answer):
    """`POST /runs`: the run made (or the existing one, for a replayed idempotency key) and its shape."""

    run_id: str
    status: RunStatus
    existing: bool
    num_nodes: int
    per_node: int
    accelerator: str
    experiment: str


class DryRunAnswer(_Answer):
    """`POST /runs` with `dry_run`: the plan, nothing created."""

    status: Literal["DRY_RUN_OK"]
    plan: dict[str, object]


class CallAnswer(_Answer):
    """`POST /calls`: the call's run."""

    run_id: str
    num_nodes: int
    world: int
    status: RunStatus


class CancelAnswer(_Answer):
    """`POST /runs/{id}/cancel`."""

    run_id: str
    status: RunStatus


class SecretPutRequest(_Request):
    """`PUT /secrets/{scope}/{key}`: the value, which no answer ever carries back."""

    value: str


class SecretRef(_Answer):
    """One secret, named (never its value): what `PUT`/`DELETE /secrets/{scope}/{key}` answer."""

    scope: str
    key: str


class SecretList(_Answer):
    """`GET /secrets`: the caller's own secrets, names only."""

    secrets: list[SecretRef]


class BlobsMissingAnswer(_Answer):
    missing: list[str]


class BlobAnswer(_Answer):
    """`PUT /blobs/{sha256}`: the blob kept, and its size in bytes."""

    digest: str
    size: int


class PermissionsAnswer(_Answer):
    """`PUT /runs/{id}/permissions`: the run's grants now (an empty list: none but its owner's)."""

    run_id: str
    permissions: list[dict[str, Any]]


class Pool(_Answer):
    """One pool of `GET /pools` (`air get pools`): its accelerators, total, used and idle, the runs holding
    them and how many wait (a pool of Ray nodes adds `ray_labels`)."""

    name: str
    accelerator_type: str
    kind: str
    slots: list[int]
    total: int
    used: int
    idle: int
    runs: list[str]
    queued: int
    default: bool


class PoolList(_Answer):
    """`GET /pools` (air.views.query.pools_view)."""

    pools: list[Pool]
    max_running_runs_per_user: int | None = None


class WhoAmI(_Answer):
    """`GET /whoami`: the caller the token stands for."""

    user: str
    admin: bool
    token_id: str


class Health(_Answer):
    """`GET /api/v1/health` (no token needed)."""

    status: str
    version: str
    api_version: int
    isolation: str = "none"
    mlflow: dict[str, object] = {}


class ErrorBody(_Answer):
    """What an error answer (and the last line of a failed stream) carries."""

    code: str = "INTERNAL_ERROR"
    kind: str = "INTERNAL"
    message: str = ""
    hint: str | None = None
    exit_code: int | None = None


# ---- follow-stream events (`GET /runs/{id}/follow`, NDJSON) -----------------------------------------


class RunEvent(_Answer):
    """The run as it is now: at every poll of a local follow; through a server, when it changed (and every
    few seconds), the last one as the run ended."""

    run: Run


class LinesEvent(_Answer):
    """New lines of one log (`label` "node" or "rank", its `index`) of attempt `attempt`, secrets masked."""

    lines: list[str]
    label: str
    index: int
    attempt: int | None = None


class NewAttemptEvent(_Answer):
    """The run moved on to another attempt: the lines that follow are that attempt's."""

    new_attempt: int
    previous: int | None = None


class SkippedEvent(_Answer):
    """This follower fell behind (it read more slowly than the run wrote): `skipped` lines were left out
    here, and the stream goes on with the newest ones. A follower that keeps up never gets one."""

    skipped: int


class ErrorEvent(_Answer):
    """A failure after the stream began (a revoked token, a grant taken back): the stream's last line."""

    error: ErrorBody


Event = RunEvent | LinesEvent | NewAttemptEvent | SkippedEvent | ErrorEvent

#: Which model a stream line is, by the key only it has.
_EVENT_KEYS: tuple[tuple[str, type[BaseModel]], ...] = (
    ("run", RunEvent), ("lines", LinesEvent), ("new_attempt", NewAttemptEvent), ("skipped", SkippedEvent),
    ("error", ErrorEvent))


def decode_event(line: bytes | str) -> Event | None:
    """One line of a follow stream as its event; None for a blank line or a kind of event this client
    does not know (a newer server's: skipped, not fatal). The one reader of follow streams."""
    if not line.strip():
        return None
    data = json.loads(line)
    if isinstance(data, dict):
        for key, model in _EVENT_KEYS:
            if key in data:
                return model.model_validate(data)  # type: ignore[return-value]
    return None


def encode_event(event: Event) -> bytes:
    """One event as a line of the stream."""
    return event.model_dump_json().encode() + b"\n"

