"""`air.Client`: the Python SDK of air runs, mirroring the CLI (`air run`, `get run`, `list runs`, `logs`,
`cancel`, `secrets`) with typed answers (`air.wire.Run` and the follow events).

One class for both places a run can live: with a server (arguments, else AIR_SERVER_URL + AIR_TOKEN, else
a `server` profile) every method is a request of the versioned API; without one it works on this
machine's run store (AIR_HOME) through the same library calls the CLI makes. The answers are the same
models either way, so code written against one runs against the other.
"""

from __future__ import annotations

import builtins
import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from air.client.http import RemoteError, ServerClient, server_client
from air.errors import AirError, UserInputError
from air.store.states import RunStatus
from air.wire import (
    BlobsMissingAnswer,
    CancelAnswer,
    DryRunAnswer,
    LinesEvent,
    LogList,
    NewAttemptEvent,
    Run,
    RunDetail,
    RunEvent,
    RunList,
    SecretList,
    SecretPutRequest,
    SecretRef,
    SkippedEvent,
    SnapshotManifest,
    SubmitAnswer,
    SubmitRequest,
)

if TYPE_CHECKING:
    from air.store.run_store import RunStore
    from air.views.follow import FollowEvent
    from air.workload.snapshot import SnapshotPlan
    from air.workload.spec import WorkloadSpec

#: A workload as `submit` takes it: a YAML file's path, or its fields as a mapping.
Workload = str | os.PathLike[str] | Mapping[str, object]
#: Seconds between two looks at a run's status while `wait` waits.
WAIT_POLL_S = 0.5

class RunWaitTimeout(AirError, TimeoutError):
    """`Client.wait` gave up before the run ended (the run goes on)."""

    code = "TIMEOUT"
    kind = "TIMEOUT"


class Client:
    """Submit, inspect, follow and cancel air runs, on an air server or on this machine.

    `Client()` picks the place as the `air` command does: AIR_SERVER_URL + AIR_TOKEN, else the profile
    (`profile=`, AIR_PROFILE, `default_profile`) when its backend is `server`, else this machine's
    AIR_HOME. `Client(url, token)` names a server directly."""

    def __init__(self, url: str | None = None, token: str | None = None, *, profile: str | None = None) -> None:
        if (url is None) != (token is None):
            raise UserInputError("Client(url, token): give both (an air server) or neither (AIR_SERVER_URL + "
                                 "AIR_TOKEN, a server profile, or this machine).")
        self.profile = profile
        self.server: ServerClient | None = ServerClient(url, token) if url and token else server_client(profile)
        self._store: RunStore | None = None

    def __repr__(self) -> str:
        return f"Client({self.server.url!r})" if self.server else "Client(local)"

    @property
    def store(self) -> RunStore:
        """This machine's run store (only without a server)."""
        if self._store is None:
            from air.store.run_store import RunStore

            self._store = RunStore()
        return self._store

    # -- submit -----------------------------------------------------------------------------------------

    def submit(self, workload: Workload, *, overrides: Sequence[str] = (), idempotency_key: str | None = None) -> Run:
        """Submit a workload (a YAML path, or its fields as a mapping; `overrides` as `--override`); the run
        as it is just after (QUEUED or PENDING). A replayed `idempotency_key` returns the existing run."""
        answer = self.send(workload, overrides=overrides, idempotency_key=idempotency_key)
        assert isinstance(answer, SubmitAnswer)
        return self.get(answer.run_id)

    def plan(self, workload: Workload, *, overrides: Sequence[str] = ()) -> dict[str, object]:
        """What `air run --dry-run` prints (nodes, commands, environment, snapshot); creates nothing."""
        answer = self.send(workload, overrides=overrides, dry_run=True)
        assert isinstance(answer, DryRunAnswer)
        return answer.plan

    def send(self, workload: Workload | WorkloadSpec, *, overrides: Sequence[str] = (),
             idempotency_key: str | None = None, dry_run: bool = False) -> SubmitAnswer | DryRunAnswer:
        """What `air run` prints from: the submit's answer (the run's id, whether a replayed key found it,
        its shape) or, with `dry_run`, the plan. The workload is validated here, with `air run`'s errors."""
        _check_key(idempotency_key)
        spec = _load(workload, overrides)
        if self.server is not None:
            return submit_to_server(self.server, spec, idempotency_key=idempotency_key, dry_run=dry_run)
        from air.config import use_reserved_pool
        from air.runs.submit import prepare_spec, submit

        prepared = prepare_spec(spec, self.profile, use_reserved=use_reserved_pool())
        plan = prepared.plan
        if dry_run:
            return DryRunAnswer(status="DRY_RUN_OK", plan=plan.describe())
        run, existing = submit(prepared, idempotency_key=idempotency_key)
        return SubmitAnswer(run_id=run.id, status=run.status, existing=existing, num_nodes=plan.num_nodes,
                            per_node=plan.per_node, accelerator=plan.accelerator, experiment=plan.experiment)

    # -- read -------------------------------------------------------------------------------------------

    def get(self, run_id: str) -> RunDetail:
        """One run, with what `air get run` shows (attempts, MLflow link, queue place, folder)."""
        return RunDetail.model_validate(self.get_data(run_id))

    def get_data(self, run_id: str) -> dict[str, object]:
        """`get`'s answer as the API words it (`air get run --json` prints it, its field order kept)."""
        if self.server is not None:
            return self.server.get(f"/runs/{run_id}")
        from air.views.query import run_detail

        return run_detail(self.store, self.store.get_run(run_id))

    def list_data(self, *, statuses: frozenset[RunStatus] = frozenset(), all_status: bool = False,
                  experiment_glob: str | None = None, user: str | None = None, accelerator_type: str | None = None,
                  num_accelerators: int | None = None, all_users: bool = False, limit: int = 20,
                  queue_for: int | None = None) -> list[dict[str, object]]:
        """`list`'s rows as the API words them (`air list runs --json` prints them). `queue_for`: on this
        machine, say why only the first N queued runs wait (each reason walks the line ahead of it)."""
        if self.server is not None:
            return list(self.server.get(
                "/runs", status=[s.value for s in sorted(statuses)] or None, all_status=all_status, limit=limit,
                experiment=experiment_glob, accelerator_type=accelerator_type, num_accelerators=num_accelerators,
                user=user, all_users=all_users)["runs"])
        from air.views.query import run_dict, run_summary, waiting_notice

        found = self.store.list_runs(statuses="all" if all_status else (statuses or None), limit=limit,
                                     experiment_glob=experiment_glob, accelerator_type=accelerator_type,
                                     num_accelerators=num_accelerators, user=user)
        queued = set([r.id for r in found if r.status is RunStatus.QUEUED][:queue_for])
        return [run_summary(self.store, r) if r.id in queued else {**run_dict(r), "queue": None,
                                                                   "waiting": waiting_notice(r)} for r in found]

    def list(self, *, status: str | RunStatus | Iterable[str | RunStatus] | None = None, all_status: bool = False,
             experiment: str | None = None, all_users: bool = False, limit: int = 20) -> list[Run]:
        """Runs, newest first: the active ones, those of `status`, or every one (`all_status`); through a
        server yours only unless `all_users`."""
        from air.store.states import statuses

        named = [status] if isinstance(status, str | RunStatus) else list(status or ())
        rows = self.list_data(statuses=statuses(named), all_status=all_status, experiment_glob=experiment,
                              all_users=all_users, limit=limit)  # an unknown status: a UserInputError here
        return RunList.model_validate({"runs": rows}).runs

    def logs(self, run_id: str, *, node: int | None = None, rank: int | None = None, attempt: int | None = None,
             tail: int | None = None, minutes: int | None = None) -> str:
        """The last lines of the run's logs (`air logs --no-follow`): every node's (or rank's), each line
        `[node N] `-prefixed when there is more than one log, or the one asked for; `minutes`: only those
        written in the last N minutes. Secrets masked."""
        events = self.events(run_id, live=False, node=node, rank=rank, attempt=attempt, tail=tail, minutes=minutes)
        chunks = [e for e in events if isinstance(e, LinesEvent)]
        several = len({(c.label, c.index) for c in chunks}) > 1
        return "".join(f"[{c.label} {c.index}] {line}\n" if several else f"{line}\n"
                       for c in chunks for line in c.lines)

    def follow(self, run_id: str, *, node: int | None = None, rank: int | None = None,
               attempt: int | None = None, tail: int | None = None, minutes: int | None = None
               ) -> Iterator[RunEvent | LinesEvent | NewAttemptEvent | SkippedEvent]:
        """The run's events until it ends (`air logs --follow`): its state at every poll (`RunEvent`), new
        log lines (`LinesEvent`) and retries (`NewAttemptEvent`); through a server, `SkippedEvent` when this
        reader fell behind and lines were left out."""
        return self.events(run_id, live=True, node=node, rank=rank, attempt=attempt, tail=tail, minutes=minutes)

    def events(self, run_id: str, *, live: bool, minutes: int | None = None,
               **where: int | None) -> Iterator[RunEvent | LinesEvent | NewAttemptEvent | SkippedEvent]:
        """`follow` (`live`) or, once, the run and the last lines of each log (`logs`), as events: what
        `air logs` prints either way. Problems with the run, `attempt`, `node` or `rank` raise here, before
        any event (on this machine; through a server, at the first event)."""
        if self.server is not None:
            return self._streamed(run_id, live=live, where={**where, "minutes": minutes})
        from air.views.follow import follow, snapshot
        from air.views.query import event_from, log_masker

        run = self.store.get_run(run_id)
        mask = log_masker(run)  # before any line: fails closed when secrets cannot be resolved
        since = None if minutes is None else time.time() - minutes * 60
        if live:
            items: Iterable[FollowEvent] = follow(run.id, store=self.store, mask=mask, since=since, **where)
        else:
            items = snapshot(self.store, run, where.get("attempt"), node=where.get("node"), rank=where.get("rank"),
                             tail=where.get("tail"), mask=mask, since=since)
        return (event_from(item, self.store) for item in items)

    def _streamed(self, run_id: str, *, live: bool, where: dict[str, int | None]
                  ) -> Iterator[RunEvent | LinesEvent | NewAttemptEvent | SkippedEvent]:
        """The server's follow stream. One that ends before the run does (the server stopped) is an error
        that says how to reattach, not a quiet end that reads as the run's."""
        assert self.server is not None
        last: Run | None = None
        for item in self.server.events(run_id, live=live, **where):
            if isinstance(item, RunEvent):
                last = item.run
            yield item
        if live and where.get("attempt") is None and (last is None or not last.is_terminal):
            raise RemoteError(f"The air server at {self.server.url} stopped streaming run {run_id} before it ended.",
                              code="UNAVAILABLE", kind="TRANSIENT",
                              hint=f"The run goes on there; reattach with: air logs {run_id} --follow")

    def log_list(self, run_id: str, attempt: int | None = None) -> LogList:
        """The logs `attempt` (default: the latest) has written so far: each one's label ("node", or
        "rank" for a local call), index and size."""
        if self.server is not None:
            return LogList.model_validate(self.server.get(f"/runs/{run_id}/logs", attempt=attempt))
        from air.views.query import log_list

        return log_list(self.store, self.store.get_run(run_id), attempt)

    def download_logs(self, run_id: str, folder: str | os.PathLike[str], attempt: int | None = None) -> LogList:
        """Copy every log of `attempt` (default: the latest) to `folder`/logs/`<label>_<index>.log`, secret
        values masked; what was copied. A copy that cannot be masked is refused before any file is written."""
        listed = self.log_list(run_id, attempt)
        target = Path(folder) / "logs"
        if self.server is not None:
            target.mkdir(parents=True, exist_ok=True)
            for log in listed.logs:
                self.server.download(f"/runs/{listed.run_id}/logs/{log.label}/{log.index}",
                                     target / f"{log.label}_{log.index}.log", attempt=listed.attempt)
            return listed
        from air.files import atomic_write_bytes
        from air.views.query import log_masker, masked_log, written_logs

        run = self.store.get_run(listed.run_id)
        mask = log_masker(run)
        mask("")  # resolves the values now: a copy is refused before any file is written
        target.mkdir(parents=True, exist_ok=True)
        for source in written_logs(self.store, run, listed.attempt)[1]:
            if source.path is not None:  # (surrogateescape: invalid UTF-8 copied as it was)
                lines = (line.encode(errors="surrogateescape") for line in masked_log(source.path, mask))
                atomic_write_bytes(target / f"{source.label}_{source.index}.log", lines, mode=0o600)
        return listed

    # -- act --------------------------------------------------------------------------------------------

    def cancel(self, run_id: str) -> CancelAnswer:
        """Cancel the run: the status the cancel left it in (TERMINATING until every process is gone, then
        CANCELED; an ended run keeps its own). `wait` waits for the end."""
        if self.server is not None:
            return CancelAnswer.model_validate(self.server.post(f"/runs/{run_id}/cancel"))
        from air.runs.cancel import cancel_run, canceled_by, local_user

        found = self.store.get_run(run_id)
        return CancelAnswer(run_id=found.id, status=cancel_run(self.store, found.id, reason=canceled_by(local_user())))

    # -- secrets (what workloads' `secrets:` read as scope/key) ----------------------------------------

    def put_secret(self, scope: str, key: str, value: str) -> SecretRef:
        """Store a secret (replacing one of the same name): your own on a server, else this machine's
        ($AIR_HOME/secrets.json, owner-only). No method ever returns a value."""
        from air.workload.secrets import parse_secret_ref, put_secret

        parse_secret_ref(f"{scope}/{key}", "secret")  # (checked here too: a server's answer to a bad name is a 404)
        if self.server is not None:
            body = SecretPutRequest(value=value).model_dump()
            return SecretRef.model_validate(self.server.call("PUT", f"/secrets/{scope}/{key}", body=body))
        put_secret(scope, key, value)
        return SecretRef(scope=scope, key=key)

    def list_secrets(self) -> builtins.list[SecretRef]:
        """The secrets' names (never their values)."""
        if self.server is not None:
            return SecretList.model_validate(self.server.get("/secrets")).secrets
        from air.workload.secrets import list_secrets

        return [SecretRef(scope=scope, key=key) for scope, key in list_secrets()]

    def delete_secret(self, scope: str, key: str) -> SecretRef:
        """Remove a secret (NotFoundError when there is none of that name)."""
        from air.workload.secrets import delete_secret, parse_secret_ref

        parse_secret_ref(f"{scope}/{key}", "secret")
        if self.server is not None:
            return SecretRef.model_validate(self.server.call("DELETE", f"/secrets/{scope}/{key}"))
        delete_secret(scope, key)
        return SecretRef(scope=scope, key=key)

    def wait(self, run_id: str, timeout: float | None = None, *, poll_s: float = WAIT_POLL_S) -> Run:
        """Block until the run ends; the ended run. `RunWaitTimeout` after `timeout` seconds (the run goes on)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            run = self.get(run_id)
            if run.is_terminal:
                return run
            if deadline is not None and time.monotonic() >= deadline:
                raise RunWaitTimeout(f"Run {run_id} is still {run.status.value} after {timeout:g} s.",
                                     hint=f"Wait longer, or follow it: air logs {run_id} --follow")
            time.sleep(poll_s if deadline is None else max(0.0, min(poll_s, deadline - time.monotonic())))


# ---- submitting to a server (the CLI's `air run` through a server uses it too) --------------------------


def _check_key(key: str | None) -> None:
    if key is not None and not 0 < len(key.strip()) <= 64:
        raise UserInputError("The idempotency key must be 1 to 64 characters.")


def _load(workload: Workload | WorkloadSpec, overrides: Sequence[str]) -> WorkloadSpec:
    """A workload validated here, with the errors `air run` gives (a YAML path, or its fields); a spec
    already validated as it is."""
    from air.workload.loading import load_workload, parse_workload
    from air.workload.spec import WorkloadSpec

    if isinstance(workload, WorkloadSpec):
        return workload
    if isinstance(workload, Mapping):
        return parse_workload(workload, source="the workload given to air.Client", overrides=overrides)
    return load_workload(os.fspath(workload), overrides)


def upload_snapshot(client: ServerClient, snapshot: SnapshotPlan) -> SnapshotManifest:
    """Ship a planned snapshot: build it here (content-addressed, cached), ask the server which blobs it
    lacks, upload those; returns the manifest the submit names."""
    from air.workload.snapshot import MODE_LINK, sha256_file
    from air.workload.snapshot_store import materialize_snapshot

    folder = materialize_snapshot(snapshot)
    files: list[dict[str, object]] = []
    local: dict[str, Path] = {}
    for entry in snapshot.entries:
        path = folder / entry.path
        if entry.mode == MODE_LINK:
            files.append({"path": entry.path, "mode": entry.mode, "target": os.readlink(path)})
            continue
        digest = sha256_file(path)
        local[digest] = path
        files.append({"path": entry.path, "mode": entry.mode, "sha256": digest})
    missing = BlobsMissingAnswer.model_validate(client.post("/blobs/missing", {"digests": sorted(local)})).missing
    for digest in missing:
        client.call("PUT", f"/blobs/{digest}", data=local[digest].read_bytes())
    return SnapshotManifest.model_validate({"name": snapshot.name, "files": files})


def submit_to_server(client: ServerClient, spec: WorkloadSpec, *, idempotency_key: str | None,
                     dry_run: bool) -> SubmitAnswer | DryRunAnswer:
    """A workload validated here submitted to the server: a requirements file's lines sent as a list, its
    code snapshot uploaded (only the blobs the server lacks)."""
    from air.config import use_reserved_pool
    from air.workload.snapshot import plan_spec_snapshot

    data = spec.to_yaml_dict()
    deps = (data.get("environment") or {}).get("dependencies")
    if isinstance(deps, str):  # a requirements file here: send its lines
        lines = [ln.strip() for ln in Path(deps).read_text(encoding="utf-8").splitlines()]
        data["environment"]["dependencies"] = [ln for ln in lines if ln and not ln.startswith("#")]
    snapshot = plan_spec_snapshot(spec)
    manifest = upload_snapshot(client, snapshot) if snapshot is not None else None
    request = SubmitRequest(spec=data, snapshot=manifest, idempotency_key=idempotency_key, dry_run=dry_run,
                            use_reserved_pool=use_reserved_pool())
    answer = client.post("/runs", request.model_dump(mode="json"))
    return DryRunAnswer.model_validate(answer) if dry_run else SubmitAnswer.model_validate(answer)

