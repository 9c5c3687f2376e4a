"""What the CLI's `--json`, the server's API and the web pages show of a run: one query layer.

Every view is plain data (JSON-ready dicts, or air.wire's models where the API answers with one) built
from the run store; the CLI prints it, the server returns it, the pages render it. The hosted CLI's
field names sit beside air's own.
"""

from __future__ import annotations

import datetime as _dt
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypedDict

from air.store.access import Viewer
from air.store.paths import CallPaths, RunPaths
from air.store.run_store import Run, RunStore
from air.store.states import RunStatus
from air.wire import LinesEvent, LogFile, LogList, NewAttemptEvent, RunEvent
from air.wire import Run as WireRun

if TYPE_CHECKING:
    from air.config import AirConfig
    from air.views.follow import FollowEvent, LogSource
from air.runs.sweep_tasks import child_run, is_sweep_spec, list_tasks, max_concurrent_of, parent_of


def rfc3339(ts: float | None) -> str | None:
    """Epoch seconds as an RFC 3339 UTC string, the form the hosted CLI's `started_at` has."""
    if ts is None:
        return None
    return _dt.datetime.fromtimestamp(ts, tz=_dt.timezone.utc).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z")


def duration_text(seconds: float | None) -> str:
    """A duration as the CLI and the pages both print it: `7s`, `3m05s`, `2h03m05s`, `-` when unknown."""
    if seconds is None:
        return "-"
    hours, rest = divmod(int(seconds), 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else (f"{minutes}m{secs:02d}s" if minutes else f"{secs}s")


def run_dict(run: Run) -> dict[str, object]:
    """A run for `--json`: the hosted CLI's field names and forms (reference §1.4: `run_id`, `run_name`,
    `started_at` as RFC 3339, `attempt_number`, `experiment_name`) beside air's own (`id`, `experiment`,
    `started_at_epoch`, ...), so scripts written for either read it. Every time is RFC 3339 (UTC) with the
    epoch seconds under `<name>_epoch`."""
    data = asdict(run)
    data.pop("spec_yaml", None)
    data["status"] = run.status.value
    data["failure_class"] = run.failure_class.value if run.failure_class else None
    data["duration_seconds"] = run.duration_seconds()
    data["attempts"] = run.attempt_count
    data["retries"] = run.retries  # preempted attempts are not retries
    data["priority_class"] = run.priority_class.value
    data["run_id"] = run.id
    data["run_name"] = run.run_name or run.experiment  # the MLflow run name, as `get run` shows it
    data["experiment_name"] = run.experiment
    for name in ("submitted_at", "started_at", "ended_at"):  # RFC 3339, the epoch seconds beside it
        data[f"{name}_epoch"] = getattr(run, name)
        data[name] = rfc3339(getattr(run, name))
    data["attempt_number"] = run.current_attempt  # 0-based, as `air logs --retry` takes it
    data["permissions"] = permissions_list(run.permissions)
    data["is_sweep"] = is_sweep_spec(run.spec_yaml)
    return data


def permissions_list(stored: str | None) -> list[dict[str, str]]:
    """A run's grants as the workload YAML spells them (`user_name`/`group_name`, `level`), not the store's text."""
    from air.store.access import grants_from_json

    return [{**({"user_name": g.user} if g.user is not None else {"group_name": str(g.group)}), "level": g.level.name}
            for g in grants_from_json(stored)]


def queue_dict(store: RunStore, run: Run, *, capacity: int | None = None) -> dict[str, object] | None:
    """The `queue` object of --json: why a QUEUED run waits (position, slots, holders, reason); None
    for a run that does not wait in a queue. `capacity` defaults to this machine's slots of its kind."""
    from air.runs.queue import queue_info

    info = queue_info(store, run, capacity=capacity)
    return None if info is None else info.to_dict()


def run_summary(store: RunStore, run: Run, *, capacity: int | None = None) -> dict[str, object]:
    """A row of `air list runs --json`, `GET /runs` (air.wire.Run) and the runs page: `run_dict`
    and, for a QUEUED run, why it waits (`queue`; `capacity` as queue_dict takes it); for a RUNNING one
    whose nodes wait before they start, what for (`waiting`)."""
    return {**run_dict(run), "queue": queue_dict(store, run, capacity=capacity), "waiting": waiting_notice(run)}


def waiting_notice(run: Run) -> str | None:
    """"its MLflow run (…) before the nodes start, for 40s": what a RUNNING run's nodes wait for, as its
    supervisor noted it (RunPaths.waiting); None when they do not wait."""
    import json

    from air.launcher.progress import quiet_for

    if run.status is not RunStatus.RUNNING:
        return None
    try:
        noted = json.loads(RunPaths(run.id).waiting.read_text())
        return f"{noted['for']}, for {quiet_for(max(time.time() - float(noted['since']), 0.0))}"
    except (OSError, ValueError, KeyError, TypeError):
        return None


def mlflow_link(run: Run) -> str | None:
    """A link into the MLflow UI for the run's latest attempt (the supervisor notes its MLflow run)."""
    from air.tracking.ui import tracking_ref_url

    if not run.mlflow_run_id or run.current_attempt is None:
        return None
    return tracking_ref_url(RunPaths(run.id).tracking(run.current_attempt))


def mlflow_recording(run: Run) -> bool:
    """An ended run whose supervisor is still alive is still recording its MLflow run (the last attempt's
    end state is written first; the supervisor then waits for the MLflow run, records its id, ends it)."""
    from air.store.liveness import supervisor_alive

    return run.status.is_terminal() and bool(supervisor_alive(run))


def run_page_url(run_id: str, pages_base: str | None = None) -> str | None:
    """The link to a run's web page: under `pages_base` (a server passes where its pages are, as its
    caller reached it), else on the `air ui` running for this AIR_HOME's store; None when no page is
    served (nothing to link to)."""
    from air.tracking.ui import pages_base_url

    base = pages_base if pages_base is not None else pages_base_url()
    return f"{base.rstrip('/')}/runs/{run_id}" if base else None


def run_folder(run: Run) -> Path:
    """Where a run's files are (every run, a call too, has one folder)."""
    return RunPaths(run.id).folder


def call_rank_logs(run: Run) -> list[dict[str, object]]:
    """A call's rank logs of its latest attempt, by rank: where `air logs ID --rank N` reads (and whether
    it exists yet)."""
    paths = CallPaths(run.id)
    logs = paths.rank_log_list(run.num_accelerators, run.current_attempt or 0)
    return [{"rank": r, "path": str(path), "exists": path.exists()} for r, path in enumerate(logs)]


def progress_view(run: Run) -> list[dict[str, Any]]:
    """Each node process of the current attempt with how long it has been quiet (no line, heartbeat or
    report), as the run controller last noted it (`attempt_<a>/progress.json`), aged to now while the
    run is active; `quiet` reads "node 1 quiet for 12m". Empty before any note."""
    import json

    from air.launcher.progress import quiet_for

    if run.current_attempt is None:
        return []
    try:
        noted = json.loads(RunPaths(run.id).progress(run.current_attempt).read_text())
    except (OSError, ValueError):
        return []
    age = max(time.time() - float(noted.get("at", 0.0)), 0.0) if not run.status.is_terminal() else 0.0
    out = []
    for proc in noted.get("processes", []):
        silent = float(proc.get("silent_s", 0.0)) + age
        out.append({**proc, "silent_s": round(silent, 1), "quiet": f"{proc.get('name')} quiet for {quiet_for(silent)}"})
    return out


def node_ended_notice(run: Run) -> str | None:
    """"node 0 ended 30s ago; node 1 still running — …" while node 0's command has ended and other nodes
    of the attempt still run (as the run controller last noted it): most often a service node 0 left
    behind on them (`ray start --block`) keeps the run alive. None otherwise."""
    import json

    from air.launcher.progress import quiet_for

    if run.current_attempt is None or run.status.is_terminal():
        return None
    try:
        noted = json.loads(RunPaths(run.id).progress(run.current_attempt).read_text())
    except (OSError, ValueError):
        return None
    ended = {int(e["node"]): float(e.get("ended_at", 0.0)) for e in noted.get("ended") or [] if "node" in e}
    still = sorted({int(p["node"]) for p in noted.get("processes", []) if "node" in p} - set(ended))
    if 0 not in ended or not still:
        return None
    nodes = ", ".join(str(n) for n in still)
    return (f"node 0 ended {quiet_for(time.time() - ended[0])} ago; node{'s' if len(still) > 1 else ''} {nodes} "
            f"still running — a Ray head or other service left behind keeps {'them' if len(still) > 1 else 'it'} "
            "alive (`ray start --block`)")


def quiet_summary(progress: list[dict[str, Any]], at_least_s: float = 60.0) -> str | None:
    """"node 1 quiet for 12m; node 3 quiet for 2m" for the processes quiet for `at_least_s` or more."""
    quiet = [p["quiet"] for p in sorted(progress, key=lambda p: -p["silent_s"]) if p["silent_s"] >= at_least_s]
    return "; ".join(quiet) or None


def checkpoint_view(run: Run) -> dict[str, object]:
    """The run's checkpoint location (AIR_CHECKPOINT_DIR, kept across attempts) and its latest checkpoint."""
    from air.runs.checkpoints import latest_checkpoint_of

    try:
        location = RunPaths(run.id).checkpoint_ref.read_text().strip() or None
    except OSError:
        location = None
    latest = latest_checkpoint_of(run.id, location) if location else None
    return {"checkpoint_dir": location, "latest_checkpoint": latest}


def run_detail(store: RunStore, run: Run, *, pages_base: str | None = None) -> dict[str, object]:
    """`air get run --json`: the run, its attempts, MLflow link, web page (`run_page_url`), folder, queue
    place and (calls) rank logs."""
    data = run_summary(store, run)
    data["mlflow_url"] = mlflow_link(run)
    data["mlflow_recording"] = mlflow_recording(run)
    data["page_url"] = run_page_url(run.id, pages_base)
    data["attempt_list"] = [
        {**asdict(a), "status": a.status.value, "failure_class": a.failure_class.value if a.failure_class else None}
        for a in store.list_attempts(run.id)]
    data["folder"] = str(run_folder(run))
    data["progress"] = progress_view(run)
    data["node_ended"] = node_ended_notice(run)
    data.update(checkpoint_view(run))
    if run.kind == "call":
        data["rank_logs"] = call_rank_logs(run)
    data["sweep"] = sweep_view(store, run)
    parent = parent_of(store, run.id)
    data["sweep_parent"] = {"run_id": parent[0], "index": parent[1]} if parent else None
    return data


def sweep_view(store: RunStore, run: Run) -> dict[str, object] | None:
    """A `for_each` sweep's counts (total, completed, succeeded, failed, active, pending: not submitted yet),
    `max_concurrent` and one row per task (its item, child run, status, times as RFC 3339 with `_epoch`
    beside); None for a run that is not a sweep (air.runs.sweep)."""
    if not is_sweep_spec(run.spec_yaml):
        return None
    from air.workload.sweep_spec import describe_item

    counts = {"total": 0, "completed": 0, "succeeded": 0, "failed": 0, "active": 0, "pending": 0}
    rows: list[dict[str, object]] = []
    for task in list_tasks(store, run.id):
        child = child_run(store, task.child_run_id)
        counts["total"] += 1
        if child is None:
            counts["pending"] += 1
        elif not child.is_terminal:
            counts["active"] += 1
        else:
            counts["completed"] += 1
            counts["succeeded" if child.status is RunStatus.SUCCESS else "failed"] += 1
        started, ended = (child.started_at, child.ended_at) if child is not None else (None, None)
        rows.append({
            "index": task.index, "parameters": task.item, "parameters_text": describe_item(task.item),
            "run_id": task.child_run_id, "status": child.status.value if child is not None else "NOT_STARTED",
            "started_at": rfc3339(started), "started_at_epoch": started,
            "ended_at": rfc3339(ended), "ended_at_epoch": ended,
            "duration_seconds": child.duration_seconds() if child is not None else None,
            "attempts": child.attempt_count if child is not None else 0,
            "termination_reason": (child.termination_reason
                                   if child is not None and child.status is not RunStatus.SUCCESS else None),
        })
    return {**counts, "max_concurrent": max_concurrent_of(run.id), "tasks": rows}


# ---- the web pages (and any API that lists, pages and follows) -------------------------------------

#: Rows per page of the runs listing.
RUNS_PER_PAGE = 50
#: Lines of a log a run page shows, read from the end (never the whole file).
LOG_TAIL_LINES = 500
#: Lines from the end a log search reads, at most: a search of a 1 GB log stays a tail read.
LOG_SEARCH_LINES = 20_000
#: The runs page counts the runs its filters match up to this many ("1000+ runs" beyond: no COUNT scan).
RUNS_COUNTED = 1000
#: Status filter values beside the statuses themselves ('all', like no filter, is what the page's
#: filter shows when none is chosen, so a link that says it works too).
STATUS_GROUPS = ("active", "ended")


def _statuses(status: str | None) -> list[RunStatus] | Literal["all"] | None:
    """`list_runs`' statuses for the page's status filter ('' or 'all', a status, 'active', 'ended')."""
    from air.errors import UserInputError

    if not status or status.lower() == "all":
        return "all"
    if status == "active":
        return None
    if status == "ended":
        return [s for s in RunStatus if s.is_terminal()]
    try:
        return [RunStatus(status.upper())]
    except ValueError:
        names = ", ".join(["all", *STATUS_GROUPS, *(s.value for s in RunStatus)])
        raise UserInputError(f"Unknown status {status!r}.", hint=f"Use one of: {names}.") from None


def _capacities() -> dict[str, int | None]:
    from air.runs.queue import local_capacity

    return {kind: local_capacity(kind) for kind in ("GPU", "CPU")}


def run_list_page(
    store: RunStore,
    *,
    status: str | None = None,
    experiment: str | None = None,
    user: str | None = None,
    accelerator: str | None = None,
    page: int = 1,
    per_page: int = RUNS_PER_PAGE,
    visible_to: Viewer | None = None,
) -> dict[str, Any]:
    """One page of every run and call, newest first, filtered as `air list runs` filters; queued rows
    say where they wait. `has_next` comes from reading one row more (no COUNT over 100,000 runs).
    `visible_to`: only the runs that viewer may see (a `private` server; store.list_runs)."""
    page = max(1, page)
    runs = store.list_runs(
        statuses=_statuses(status), limit=per_page + 1, offset=(page - 1) * per_page,
        experiment_glob=experiment or None, user=user or None, accelerator_type=accelerator or None,
        visible_to=visible_to,
    )
    capacities = _capacities()
    rows = [run_summary(store, run, capacity=capacities.get(run.slot_kind)) for run in runs[:per_page]]
    if page == 1 and len(runs) <= per_page:
        counted = len(runs)
    else:
        counted = len(store.list_runs(
            statuses=_statuses(status), limit=RUNS_COUNTED + 1, experiment_glob=experiment or None,
            user=user or None, accelerator_type=accelerator or None, visible_to=visible_to))
    queued = store.list_runs(statuses=[RunStatus.QUEUED], limit=None, visible_to=visible_to)
    queue = [q for q in (queue_dict(store, r, capacity=capacities.get(r.slot_kind)) for r in queued) if q]
    queue.sort(key=lambda q: (q["kind"], q["position"] is None, q["position"] or 0, q["run_id"]))
    return {
        "runs": rows, "page": page, "per_page": per_page, "has_next": len(runs) > per_page,
        "count": min(counted, RUNS_COUNTED), "count_capped": counted > RUNS_COUNTED,
        "first": (page - 1) * per_page + 1 if rows else 0, "last": (page - 1) * per_page + len(rows),
        "queue": queue, "any_active": bool(store.list_runs(limit=1)),
        "filters": {"status": "" if _statuses(status) == "all" else status or "", "experiment": experiment or "", "user": user or "",
                    "accelerator": accelerator or ""},
    }


class _SlotHolder(TypedDict):
    """A run holding slots of one kind, as the capacity page lists it."""

    run_id: str
    status: str
    user: str
    experiment: str
    slots: list[int]


def capacity_view(store: RunStore) -> dict[str, object]:
    """This machine's slots (the local backend's capacity) and which run holds which, from the slot
    ledger; and the active runs on Ray profiles, whose placement Ray decides."""
    import socket

    pools = []
    for kind, capacity in _capacities().items():
        holders = store.slot_holders(kind)
        runs: dict[str, _SlotHolder] = {}
        for index, run_id in holders.items():
            if run_id not in runs:
                try:
                    holder = store.get_run(run_id)
                    runs[run_id] = {"run_id": run_id, "status": holder.status.value, "user": holder.user,
                                    "experiment": holder.experiment, "slots": []}
                except Exception:  # it ended and was pruned in between
                    runs[run_id] = {"run_id": run_id, "status": "?", "user": "", "experiment": "", "slots": []}
            runs[run_id]["slots"].append(index)
        total = max([capacity or 0, *(i + 1 for i in holders)])
        pools.append({
            "kind": kind, "capacity": capacity, "used": len(holders),
            "free": None if capacity is None else max(capacity - len(holders), 0),
            "slots": [{"index": i, "run_id": holders.get(i)} for i in range(total)],
            "holders": list(runs.values()),
        })
    remote = [run_dict(r) for r in store.list_runs(limit=None) if r.backend != "local"
              and r.status in (RunStatus.RUNNING, RunStatus.TERMINATING, RunStatus.QUEUED)]
    return {"node": socket.gethostname(), "backend": "local", "pools": pools, "remote": remote,
            "named_pools": _named_pools(store)}


def _named_pools(store: RunStore) -> dict[str, object] | None:
    """The pools config.yaml names (`air get pools`), or None when it names none (the slots above are the
    one default pool) or they cannot be read now (the page still shows the slots)."""
    from air.config import load_config

    try:
        return pools_view(store) if load_config().pools else None
    except Exception as exc:  # a bad config or an unreachable Ray cluster: say so, keep the page
        return {"pools": [], "error": str(exc), "max_running_runs_per_user": None}


def pools_view(store: RunStore) -> dict[str, Any]:
    """`air get pools` (locally and `GET /api/v1/pools`): each pool's accelerator type and total, used
    and idle accelerators, from config.yaml `pools:` and the slot ledger. With no pools configured, the
    one `default` pool is the whole machine (a row per kind of slot it has)."""
    from air.accelerators import discover
    from air.config import DEFAULT_POOL, load_config

    config = load_config()
    capacities = _capacities()
    try:
        gpu_model = discover().gpu_model or "GPU"
    except Exception:  # no way to tell the model: say GPU
        gpu_model = "GPU"
    queued: dict[tuple[str | None, str], int] = {}
    for run in store.list_runs(statuses=[RunStatus.QUEUED], limit=None):
        if run.backend == "local" and not store.claimed_slots(run.id):
            queued[(run.pool, run.slot_kind)] = queued.get((run.pool, run.slot_kind), 0) + 1
    entries: list[tuple[str, str, list[int], str | None]]
    if config.ray_pools:
        return {"pools": _ray_pools(store, config, gpu_model),
                "max_running_runs_per_user": config.max_running_runs_per_user}
    if config.pools:
        entries = [(name, pool.accelerator, list(pool.slots or ()), name) for name, pool in config.pools.items()]
    else:
        entries = [(DEFAULT_POOL, kind, list(range(capacity or 0)), None) for kind, capacity in capacities.items()
                   if capacity or kind == "CPU"]
    rows = []
    for name, kind, slots, stored_as in entries:
        holders = store.slot_holders(kind)
        held = [i for i in slots if i in holders]
        rows.append({
            "name": name, "accelerator_type": "CPU" if kind == "CPU" else gpu_model, "kind": kind,
            "slots": slots, "total": len(slots), "used": len(held), "idle": len(slots) - len(held),
            "runs": sorted({holders[i] for i in held}), "queued": queued.get((stored_as, kind), 0),
            "default": name == (config.default_pool or entries[0][0]),
        })
    return {"pools": rows, "max_running_runs_per_user": config.max_running_runs_per_user}


def _ray_pools(store: RunStore, config: AirConfig, gpu_model: str) -> list[dict[str, object]]:
    """Pools of Ray nodes: accelerators of the alive nodes whose labels include the pool's, and how many of
    them Ray has handed out (read from the cluster of the default profile); the runs admitted to each
    (they hold its admission until they end) and how many wait behind them."""
    from air.backends import backend_for
    from air.config import resolve_profile

    backend = backend_for(resolve_profile(None, config))
    usage = getattr(backend, "labelled_usage", None)
    active = [r for r in store.list_runs(statuses=[RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.TERMINATING],
                                         limit=None) if r.backend != "local" and r.pool]
    admitted = {r.id for r in active if store.claimed_slots(r.id)}
    rows = []
    for name, pool in config.pools.items():
        kind = pool.accelerator
        total, used, models = usage(pool.ray_labels, kind) if usage else (0, 0, [])
        mine = [r for r in active if r.pool == name]
        rows.append({
            "name": name, "accelerator_type": "CPU" if kind == "CPU" else ("/".join(models) or gpu_model),
            "kind": kind, "ray_labels": pool.ray_labels, "slots": [], "total": total, "used": used,
            "idle": total - used, "runs": sorted(r.id for r in mine if r.id in admitted),
            "queued": sum(r.status is RunStatus.QUEUED and r.id not in admitted for r in mine),
            "default": name == (config.default_pool or next(iter(config.pools))),
        })
    return rows


def log_files(run: Run, attempt: int) -> list[dict[str, Any]]:
    """The logs of one attempt a page shows: a local call's per rank, any other run's per node
    (`air.views.follow.log_sources`, what `air logs` reads)."""
    from air.views.follow import log_sources

    return [{"label": s.label, "index": s.index, "path": s.path, "exists": s.path is not None and s.path.exists()}
            for s in log_sources(run, attempt)]


def written_logs(store: RunStore, run: Run, attempt: int | None) -> tuple[int, list[LogSource]]:
    """The logs of `attempt` (default: the latest) that exist so far, and its index: what the API's
    `GET /runs/{id}/logs` lists and `air logs --download-to` copies (on this machine or through a server)."""
    from air.views.follow import attempt_index, log_sources

    index = attempt_index(store, run, attempt)
    return index, [s for s in log_sources(run, index) if s.path is not None and s.path.exists()]


def log_list(store: RunStore, run: Run, attempt: int | None) -> LogList:
    """`written_logs` as the API words it: each log's label, index and size."""
    index, written = written_logs(store, run, attempt)
    return LogList(run_id=run.id, attempt=index,
                   logs=[LogFile(label=s.label, index=s.index, bytes=s.path.stat().st_size) for s in written if s.path])


def event_from(item: FollowEvent, store: RunStore | None = None) -> RunEvent | LinesEvent | NewAttemptEvent:
    """What `air.views.follow` yields on the run's machine (a store `Run`, `Lines`, `NewAttempt`) as the
    event a client reads: the server streams it, the SDK yields it when it follows a run locally. With
    `store`, a QUEUED run's event says why it waits (`queue`: `air run --watch` prints it without asking)."""
    from air.views.follow import Lines, NewAttempt

    if isinstance(item, Lines):
        return LinesEvent(lines=item.lines, label=item.source.label, index=item.source.index, attempt=item.attempt)
    if isinstance(item, NewAttempt):
        return NewAttemptEvent(new_attempt=item.attempt, previous=item.previous)
    if store is not None and item.status is RunStatus.QUEUED:
        return RunEvent(run=WireRun.model_validate(run_summary(store, item)))
    return RunEvent(run=WireRun.model_validate(run_dict(item)))


#: The most of one log line held at once while a log is served (the reader may be the server's account):
#: a run may print gigabytes with no newline, which the pump writes on in pieces.
LOG_PIECE_CHARS = 1 << 20


def masked_log(path: Path, mask: Callable[[str], str]) -> Iterator[str]:
    """A whole log line by line through `mask` (logs an older air wrote may hold values), byte for byte
    otherwise: surrogateescape keeps invalid UTF-8 as it was (encode it back the same way). A line longer
    than LOG_PIECE_CHARS comes in pieces; a masker that can `split` keeps a value cut by a piece boundary
    whole (a run's RunMasker does)."""
    split: Callable[[str], tuple[str, str]] | None = getattr(mask, "split", None)
    held = ""
    with open(path, encoding="utf-8", errors="surrogateescape", newline="") as log:
        while piece := log.readline(LOG_PIECE_CHARS):
            text = held + piece
            held = ""
            if text.endswith("\n"):
                yield mask(text[:-1]) + "\n"
            elif split is not None:
                shown, held = split(text)
                if shown:
                    yield shown
            else:
                yield mask(text)
    if held:
        yield mask(held)


def log_masker(run: Run) -> Callable[[str], str]:
    """Hides the run's secret values in what `air logs`, `--watch`, the API and the pages show (fails
    closed: SecretMaskingError when they cannot be resolved any more, before any line is shown)."""
    from air.workload.secrets import masker_for_run

    return masker_for_run(run.id, None if run.kind == "call" else RunPaths(run.id).submission)


def marked_line(number: int | None, text: str) -> dict[str, object]:
    """One log line as a page shows it: the failure signature air detects in it, and whether it reads
    as an error line (`air.runs.reasons`' rules)."""
    from air.runs.reasons import mark_line

    signature, error = mark_line(text)
    return {"n": number, "text": text, "error": error,
            "signature": signature.name if signature else None,
            "signature_label": signature.label if signature else None}


def log_view(run: Run, path: Path, *, lines: int = LOG_TAIL_LINES, query: str | None = None) -> dict[str, object]:
    """The last `lines` lines of a log (or, with `query`, the last matching ones among the final
    LOG_SEARCH_LINES), masked and marked, read from the end of the file. `error` says why nothing shows."""
    from air.errors import AirError
    from air.views.logtail import complete_tail, tail_lines

    try:
        mask = log_masker(run)
        mask("")  # resolves the secret values now (fails closed here, not half-way through the lines)
        _, offset = complete_tail(path, 0)  # where a live stream picks up (after the last complete line)
        if query:
            found = [t for t in tail_lines(path, LOG_SEARCH_LINES) if query.lower() in t.lower()]
            texts, truncated = found[-lines:], len(found) > lines
        else:
            texts = tail_lines(path, lines + 1)
            truncated = len(texts) > lines
            texts = texts[-lines:]
    except FileNotFoundError:
        return {"lines": [], "truncated": False, "offset": 0, "error": None, "missing": True}
    except AirError as exc:
        return {"lines": [], "truncated": False, "offset": 0, "error": exc.message, "missing": False}
    return {"lines": [marked_line(None, mask(t)) for t in texts], "truncated": truncated,
            "offset": offset, "error": None, "missing": False}


def failing_index(reason: str | None) -> int | None:
    """The node (or rank) a termination reason names ("… (node 1)", "Rank 1: …"), if any."""
    import re

    found = re.search(r"\b(?:node|rank) (\d+)\b", reason or "", re.IGNORECASE)  # "Rank 1: ValueError…"
    return int(found.group(1)) if found else None


def attempt_views(store: RunStore, run: Run) -> list[dict[str, Any]]:
    """Each attempt with its MLflow link, its failing node and where it sits on the run's timeline."""
    from air.tracking.ui import tracking_ref_url

    attempts = store.list_attempts(run.id)
    start = min([a.started_at for a in attempts], default=run.submitted_at)
    now = time.time()
    end = max([a.ended_at if a.ended_at is not None else now for a in attempts], default=start)
    span = max(end - start, 1e-9)
    out = []
    for a in attempts:
        a_end = a.ended_at if a.ended_at is not None else end
        out.append({
            "index": a.index, "status": a.status.value, "started_at": rfc3339(a.started_at),
            "ended_at": rfc3339(a.ended_at), "duration_seconds": a.duration_seconds(),
            "termination_reason": a.termination_reason,
            "failure_class": a.failure_class.value if a.failure_class else None,
            "exit_code": a.exit_code, "signal": a.signal_name, "mlflow_run_id": a.mlflow_run_id,
            "mlflow_url": tracking_ref_url(RunPaths(run.id).tracking(a.index)),
            "failing": failing_index(a.termination_reason),
            "left_pct": round((a.started_at - start) / span * 100, 2),
            "width_pct": round(max((a_end - a.started_at) / span * 100, 0.5), 2),
        })
    return out


def attempt_stacks(run: Run, attempt: int) -> list[dict[str, object]]:
    """The Python stacks air saved when an attempt hung (`attempt_<a>/stacks/node_<n>.txt`, a call's
    `rank_<r>.txt`), each `name` ("node 1") and masked `text`, in node order; [] when none were saved."""
    import re

    from air.errors import AirError

    found = sorted(RunPaths(run.id).stacks(attempt, "node 0").parent.glob("*.txt"))
    if not found:
        return []

    def order(path: Path) -> tuple[int, str]:
        number = re.search(r"(\d+)", path.name)
        return (int(number.group(1)) if number else 0, path.name)

    try:
        mask = log_masker(run)
        mask("")
    except AirError as exc:
        return [{"name": "stacks", "text": "", "error": exc.message}]
    out: list[dict[str, object]] = []
    for path in sorted(found, key=order):
        name = path.name.split(".")[0].replace("_", " ")
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            out.append({"name": name, "text": "", "error": f"Could not read {path}: {exc.strerror}"})
            continue
        out.append({"name": name, "text": mask(text.rstrip("\n")), "error": None, "path": str(path)})
    return out


def attempt_metrics(mlflow_run_id: str | None) -> dict[str, object]:
    """An attempt's metric histories from its MLflow run: the training metrics, and the system
    metrics per node (`system/node_<n>/<name>`)."""
    from air.tracking.history import metric_histories

    histories = metric_histories(mlflow_run_id) if mlflow_run_id else {}
    training = {k: v for k, v in histories.items() if not k.startswith("system/")}
    system: dict[str, dict[str, list[tuple[float, float, float]]]] = {}
    for key, points in histories.items():
        if key.startswith("system/"):
            node, _, name = key.removeprefix("system/").partition("/")
            system.setdefault(node, {})[name or node] = points
    return {"training": training, "system": system}
