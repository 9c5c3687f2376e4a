"""`air get run ID` and `air list runs`."""

from __future__ import annotations

from typing import Any

import click

from air.cli.complete import complete_run_id
from air.cli.main import common, settings
from air.cli.output import envelope, fmt_time, print_fields, print_table, shape_text
from air.errors import UserInputError
from air.runs.states import RunStatus
from air.runs.states import statuses as parse_statuses
from air.runs.store import RunStore
from air.runs.views import (
    attempt_from_dict,
    duration_text,
    queue_dict,
    quiet_summary,
    run_detail,
    run_dict,
    run_from_dict,
)


@click.group()
def get() -> None:
    """Show one object in detail."""


@get.command("run")
@click.argument("run_id", shell_complete=complete_run_id)
@common
def get_run(run_id: str) -> None:
    """A run: status, attempts, termination reason, MLflow run, logs."""
    from air.cli.remote import remote

    client = remote()
    if client is not None:
        detail = client.get(f"/runs/{run_id}")
    else:
        store = RunStore()
        detail = run_detail(store, store.get_run(run_id))
    if settings().json:
        envelope(detail)
        return
    print_run_detail(detail, ui_hint=client is None)


@get.command("pools")
@common
def get_pools() -> None:
    """Pools: each one's accelerator type and total/used/idle accelerators (config.yaml `pools:`)."""
    from air.cli.remote import remote
    from air.runs.views import pools_view

    client = remote()
    data = client.get("/pools") if client is not None else pools_view(RunStore())
    if settings().json:
        envelope(data)
        return
    print_table(["POOL", "ACCELERATOR", "TOTAL", "USED", "IDLE", "QUEUED", "SLOTS"], [
        [p["name"] + (" (default)" if p["default"] and len(data["pools"]) > 1 else ""), p["accelerator_type"],
         str(p["total"]), str(p["used"]), str(p["idle"]), str(p["queued"]), _slot_ranges(p["slots"])]
        for p in data["pools"]])
    if data.get("max_running_runs_per_user"):
        click.echo(f"At most {data['max_running_runs_per_user']} running runs per user; the rest wait.")


def _slot_ranges(slots: list[int]) -> str:
    """[0, 1, 2, 5] → "0-2,5"."""
    spans: list[list[int]] = []
    for index in sorted(slots):
        if spans and spans[-1][1] == index - 1:
            spans[-1][1] = index
        else:
            spans.append([index, index])
    return ",".join(f"{lo}-{hi}" if lo != hi else str(lo) for lo, hi in spans) or "-"


def print_run_detail(detail: dict[str, Any], *, ui_hint: bool = True) -> None:
    """`air get run` from `run_detail`'s dict (this machine's store or a server's answer alike)."""
    run = run_from_dict(detail)
    attempts = [attempt_from_dict(a) for a in detail.get("attempt_list") or []]
    link = detail.get("mlflow_url")
    queue = detail.get("queue")
    pairs = [
        ("Run", run.id), ("Status", run.status.value), *([("Waiting", queue["reason"])] if queue else []),
        ("Experiment", run.experiment), ("MLflow run name", run.run_name or run.experiment),
        ("Accelerators", shape_text(run.num_nodes, run.accelerator_type, run.num_accelerators)),
        ("Backend", f"{run.backend} (profile {run.profile or 'local'})"), *([("Pool", run.pool)] if run.pool else []),
        ("User", run.user or "-"),
        ("Submitted", fmt_time(run.submitted_at)), ("Started", fmt_time(run.started_at)),
        ("Ended", fmt_time(run.ended_at)), ("Duration", duration_text(run.duration_seconds())),
        ("Attempts", f"{run.attempt_count} (retries: {max(run.attempt_count - 1, 0)})"),
    ]
    if run.termination_reason and not run.status.value == "SUCCESS":
        pairs.append(("Termination reason", run.termination_reason))
    quiet = quiet_summary(detail.get("progress") or []) if not run.status.is_terminal() else None
    if quiet:
        pairs.append(("Progress", quiet))
    if detail.get("checkpoint_dir"):
        pairs.append(("Checkpoints", detail["checkpoint_dir"]))
        pairs.append(("Last checkpoint", detail.get("latest_checkpoint") or "-"))
    if run.failure_class:
        pairs.append(("Failure class", run.failure_class.value))
    pairs.append(("MLflow run", run.mlflow_run_id or "-"))
    if link:
        pairs.append(("MLflow UI", f"{link}   (start the UI with: air ui)" if ui_hint else link))
    if detail.get("page_url"):
        pairs.append(("Page", str(detail["page_url"])))
    if run.kind == "call":
        pairs.insert(1, ("Kind", f"call of {run.run_name or 'a function'} (@distributed)"))
    pairs.append(("Folder", str(detail.get("folder"))))
    print_fields(pairs)
    if run.kind == "call":
        print()
        print_table(["RANK", "LOG"], [[str(r["rank"]), r["path"] + ("" if r["exists"] else "  (not written)")]
                                      for r in detail.get("rank_logs") or []])
        if run.backend == "local":
            print(f"\nLogs: air logs {run.id} [--rank N]")
            return
    if attempts:
        print()
        print_table(["ATTEMPT", "STATUS", "STARTED", "DURATION", "REASON", "MLFLOW RUN"], [
            [str(a.index), a.status.value, fmt_time(a.started_at), duration_text(a.duration_seconds()),
             a.termination_reason or "", a.mlflow_run_id or ""] for a in attempts], wrap=("REASON",))
        print(f"\nLogs: air logs {run.id} [--node N] [--retry A]")


@click.group("list")
def list_() -> None:
    """List objects."""


#: `air list runs --filter KEY=VALUE`: each key and what its value is.
FILTER_KEYS = {
    "status": "a run state (repeatable, or comma-separated: status=FAILED,TIMEDOUT)",
    "user": "who submitted it, exactly",
    "experiment": "a case-insensitive glob (qwen*)",
    "accelerator_type": "a case-insensitive substring (H100, GPU_8xH100)",
    "num_accelerators": "a positive integer",
}
_FILTER_HINT = "Filters: " + "; ".join(f"{k}=… {v}" for k, v in FILTER_KEYS.items()) + "."


def _filters(values: tuple[str, ...]) -> dict[str, Any]:
    """`--filter KEY=VALUE`s as RunStore.list_runs keywords (status → `statuses`); a repeated key other
    than status must repeat the same value (a run has one user, one experiment…)."""
    out: dict[str, Any] = {}
    for item in values:
        key, sep, value = item.partition("=")
        key, value = key.strip().lower(), value.strip()
        if not sep or not value:
            raise UserInputError(f"--filter {item!r} must look like KEY=VALUE.", hint=_FILTER_HINT)
        if key not in FILTER_KEYS:
            raise UserInputError(f"Unknown filter key {key!r}; the valid keys are {', '.join(FILTER_KEYS)}.",
                                 hint=_FILTER_HINT)
        if key == "status":
            out["statuses"] = out.get("statuses", frozenset()) | parse_statuses(
                v for v in (p.strip() for p in value.split(",")) if v)
            continue
        name = {"experiment": "experiment_glob"}.get(key, key)
        parsed: Any = value
        if key == "num_accelerators":
            if not value.isdigit() or int(value) <= 0:
                raise UserInputError(f"--filter num_accelerators must be a positive integer, got {value!r}.")
            parsed = int(value)
        if name in out and out[name] != parsed:
            raise UserInputError(f"--filter {key}= is given twice ({out[name]!r} and {parsed!r}); a run matches "
                                 "one.", hint="Give that key once (only status= takes several values).")
        out[name] = parsed
    return out


@list_.command("runs")
@click.option("--all-status", "all_status", is_flag=True, help="Include ended runs (default: active ones only).")
@click.option("--status", "status_names", multiple=True, metavar="STATUS", help="Only runs in these states.")
@click.option("--limit", default=20, show_default=True, type=click.IntRange(min=1), help="At most this many runs.")
@click.option("--filter", "filters", multiple=True, metavar="KEY=VALUE",
              help="status=STATE, user=NAME, experiment=GLOB, accelerator_type=TEXT (substring), "
              "num_accelerators=N. Repeatable; every filter must match.")
@click.option("--all-users", "all_users", is_flag=True,
              help="Through an air server: everyone's runs (default: yours), with a USER column.")
@common
def list_runs(all_status: bool, status_names: tuple[str, ...], limit: int, filters: tuple[str, ...],
              all_users: bool) -> None:
    """Runs, newest first."""
    from air.cli.remote import remote

    where = _filters(filters)
    named = (parse_statuses(status_names) if status_names else frozenset()) | where.pop("statuses", frozenset())
    wanted: Any = named or ("all" if all_status else None)  # a status filter narrows --all-status
    with_user = all_users or "user" in where
    client = remote()

    def fetch(wanted: Any, all_status: bool, limit: int) -> list[dict[str, Any]]:
        if client is not None:
            return list(client.get(
                "/runs", all_users=all_users, all_status=all_status, limit=limit,
                status=sorted(s.value for s in wanted) if isinstance(wanted, frozenset) else None,
                experiment=where.get("experiment_glob"), accelerator_type=where.get("accelerator_type"),
                num_accelerators=where.get("num_accelerators"), user=where.get("user"))["runs"])
        store = RunStore()
        return [{**run_dict(r), "queue": queue_dict(store, r)}
                for r in store.list_runs(statuses=wanted, limit=limit, **where)]

    runs = fetch(wanted, all_status and not named, limit)
    if settings().json:
        envelope({"runs": runs})
        return
    if not runs and wanted is None:  # nothing active: say so, and show what ended last
        recent = fetch("all", True, RECENT_WHEN_IDLE)
        if recent:
            print("No active runs. The most recently ended:")
            print_runs(recent, all_status=True, with_user=with_user)
            print("\nEvery run: air list runs --all-status")
            return
    print_runs(runs, all_status=all_status or bool(named), with_user=with_user)


#: `air list runs` with nothing active shows this many of the most recently ended runs instead.
RECENT_WHEN_IDLE = 5


def print_runs(runs: list[dict[str, Any]], *, all_status: bool, with_user: bool = False) -> None:
    """`air list runs` from `run_dict`s (this machine's store or a server's answer alike)."""
    if not runs:
        print("No runs." if all_status else "No active runs. (--all-status shows ended runs too)")
        return
    records = [run_from_dict(r) for r in runs]
    header = ["RUN", "KIND", "STATUS", "EXPERIMENT", "ACCELERATORS", "SUBMITTED", "DURATION", "ATTEMPTS"]
    rows = [[r.id, r.kind, r.status.value, r.experiment, shape_text(r.num_nodes, r.accelerator_type, r.num_accelerators),
             fmt_time(r.submitted_at), duration_text(r.duration_seconds()), str(r.attempt_count)] for r in records]
    if with_user:
        header.insert(1, "USER")
        for row, r in zip(rows, records, strict=True):
            row.insert(1, r.user or "-")
    print_table(header, rows)
    waiting = [(r["id"], r.get("queue")) for r in runs if r["status"] == RunStatus.QUEUED.value]
    if waiting:
        print("\nWaiting:")
        for run_id, queue in waiting:
            print(f"  {run_id}  {queue['reason'] if queue else 'QUEUED'}")


list_.add_command(get_pools, "pools")  # `air list pools` is `air get pools`: both read naturally
