"""`air get run ID` and `air list runs`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from air.cli.complete import complete_run_id
from air.cli.main import common, settings
from air.cli.output import envelope, fmt_time, print_fields, print_table, shape_text
from air.errors import UserInputError
from air.store.run_store import RunStore
from air.store.states import RunStatus
from air.store.states import statuses as parse_statuses
from air.views.query import duration_text, quiet_summary

if TYPE_CHECKING:
    from air.wire import Run, RunDetail


@click.group()
def get() -> None:
    """Show one object in detail."""


@get.command("run")
@click.argument("run_id", shell_complete=complete_run_id)
@common
def get_run(run_id: str) -> None:
    """A run: status, attempts, termination reason, MLflow run, logs."""
    from air.client.sdk import Client
    from air.wire import RunDetail

    client = Client(profile=settings().profile)
    detail = client.get_data(run_id)
    if settings().json:
        envelope(detail)
        return
    print_run_detail(RunDetail.model_validate(detail), ui_hint=client.server is None,
                     server=client.server.url if client.server is not None else None)


@get.command("pools")
@common
def get_pools() -> None:
    """Pools: each one's accelerator type and total/used/idle accelerators (config.yaml `pools:`)."""
    from air.client import server_client
    from air.views.query import pools_view

    client = server_client(settings().profile)  # a server profile's, or None: this machine
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


def print_run_detail(run: RunDetail, *, ui_hint: bool = True, server: str | None = None) -> None:
    """`air get run` (this machine's store or a server's answer alike). Through a server (`server`, its
    URL) the run's backend and profile are the server's, and are shown as the server's."""
    profile = run.profile or "local"
    backend = (f"{run.backend} on the server {server} (profile on the server: {profile})" if server
               else f"{run.backend} (profile {profile})")
    pairs = [
        ("Run", run.run_id), ("Status", run.status.value),
        *([("Waiting", run.queue["reason"])] if run.queue else []),
        *([("Waiting", f"its nodes wait for {run.waiting}")] if run.waiting else []),
        ("Experiment", run.experiment_name), ("MLflow run name", run.run_name or run.experiment_name),
        ("Accelerators", shape_text(run.num_nodes, run.accelerator_type, run.num_accelerators)),
        ("Backend", backend), *([("Pool", run.pool)] if run.pool else []),
        ("User", run.user or "-"),
        ("Submitted", fmt_time(run.submitted_at)), ("Started", fmt_time(run.started_at)),
        ("Ended", fmt_time(run.ended_at)), ("Duration", duration_text(run.duration_seconds)),
        ("Attempts", f"{run.attempts} (retries: {run.retries}"
                     + (f", preempted: {run.preemptions}" if run.preemptions else "") + ")"),
        ("Priority", run.priority_class),
    ]
    if run.termination_reason and not run.ok:
        pairs.append(("Termination reason", run.termination_reason))
    quiet = quiet_summary(run.progress) if not run.is_terminal else None
    if quiet:
        pairs.append(("Progress", quiet))
    if run.checkpoint_dir:
        pairs.append(("Checkpoints", run.checkpoint_dir))
        pairs.append(("Last checkpoint", run.latest_checkpoint or "-"))
    if run.failure_class:
        pairs.append(("Failure class", run.failure_class.value))
    mlflow_run = run.mlflow_run_id or "-"
    if run.mlflow_recording:  # ended; its supervisor is still recording its MLflow run
        mlflow_run = f"{run.mlflow_run_id}   (recording…)" if run.mlflow_run_id else "recording…"
    pairs.append(("MLflow run", mlflow_run))
    if run.mlflow_url:
        pairs.append(("MLflow UI", f"{run.mlflow_url}   (start the UI with: air ui)" if ui_hint else run.mlflow_url))
    if run.page_url:
        pairs.append(("Page", run.page_url))
    if run.kind == "call":
        pairs.insert(1, ("Kind", f"call of {run.run_name or 'a function'} (@distributed)"))
    pairs.append(("Folder", str(run.folder)))
    if run.sweep_parent:
        pairs.insert(1, ("Sweep", f"task {run.sweep_parent['index']} of sweep {run.sweep_parent['run_id']}"))
    print_fields(pairs)
    if run.sweep:
        _print_sweep(run.run_id, run.sweep)
        return
    if run.kind == "call":
        print()
        print_table(["RANK", "LOG"], [[str(r.rank), r.path + ("" if r.exists else "  (not written)")]
                                      for r in run.rank_logs])
        if run.backend == "local":
            print(f"\nLogs: air logs {run.run_id} [--rank N]")
            return
    if run.attempt_list:
        print()
        print_table(["ATTEMPT", "STATUS", "STARTED", "DURATION", "REASON", "MLFLOW RUN"], [
            [str(a.index), a.status.value, fmt_time(a.started_at), duration_text(a.duration_seconds()),
             a.termination_reason or "", a.mlflow_run_id or ""] for a in run.attempt_list], wrap=("REASON",))
        print(f"\nLogs: air logs {run.run_id} [--node N] [--retry A]")


def _print_sweep(run_id: str, sweep: dict[str, Any]) -> None:
    """A sweep's counts and its tasks (one child run each)."""
    print()
    print_fields([("Total", str(sweep["total"])), ("Completed", str(sweep["completed"])),
                  ("Succeeded", str(sweep["succeeded"])), ("Failed", str(sweep["failed"])),
                  ("Active", str(sweep["active"])), ("Not started", str(sweep["pending"])),
                  ("Max concurrent", str(sweep.get("max_concurrent") or "all"))])
    print()
    print_table(["TASK", "RUN", "STATUS", "PARAMETERS", "STARTED", "DURATION", "REASON"], [
        [str(t["index"]), t["run_id"] or "-", t["status"], t["parameters_text"], fmt_time(t["started_at_epoch"]),
         duration_text(t["duration_seconds"]), t["termination_reason"] or ""] for t in sweep["tasks"]],
        wrap=("REASON",))
    print(f"\nA task: air get run RUN / air logs RUN   Cancel the sweep and its tasks: air cancel {run_id}")


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


#: How many queued runs `air list runs` says why of (each reason walks the line ahead of it).
WAITING_SHOWN = 3


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
        parsed: str | int = value
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
    from air.client.sdk import Client

    where = _filters(filters)
    named = (parse_statuses(status_names) if status_names else frozenset()) | where.pop("statuses", frozenset())
    with_user = all_users or "user" in where
    client = Client(profile=settings().profile)

    def fetch(all_status: bool, limit: int) -> list[dict[str, object]]:
        return client.list_data(statuses=named, all_status=all_status, limit=limit, all_users=all_users,
                                queue_for=None if settings().json else WAITING_SHOWN, **where)

    runs = fetch(all_status and not named, limit)
    if settings().json:
        envelope({"runs": runs})
        return
    from air.wire import RunList

    if not runs and not named and not all_status:  # nothing active: say so, and show what ended last
        recent = RunList.model_validate({"runs": fetch(True, RECENT_WHEN_IDLE)}).runs
        if recent:
            print("No active runs. The most recently ended:")
            print_runs(recent, all_status=True, with_user=with_user)
            print("\nEvery run: air list runs --all-status")
            return
    print_runs(RunList.model_validate({"runs": runs}).runs, all_status=all_status or bool(named), with_user=with_user)


#: `air list runs` with nothing active shows this many of the most recently ended runs instead.
RECENT_WHEN_IDLE = 5


def print_runs(runs: list[Run], *, all_status: bool, with_user: bool = False) -> None:
    """`air list runs` (this machine's store or a server's answer alike)."""
    if not runs:
        print("No runs." if all_status else "No active runs. (--all-status shows ended runs too)")
        return
    header = ["RUN", "KIND", "STATUS", "EXPERIMENT", "ACCELERATORS", "SUBMITTED", "DURATION", "ATTEMPTS"]
    rows = [[r.run_id, "sweep" if r.is_sweep else r.kind, r.status.value, r.experiment_name,
             shape_text(r.num_nodes, r.accelerator_type, r.num_accelerators), fmt_time(r.submitted_at),
             duration_text(r.duration_seconds), str(r.attempts)] for r in runs]
    if with_user:
        header.insert(1, "USER")
        for row, r in zip(rows, runs, strict=True):
            row.insert(1, r.user or "-")
    print_table(header, rows)
    waiting = [r for r in runs if r.status is RunStatus.QUEUED or r.waiting]
    if waiting:
        print("\nWaiting:")
        for r in waiting[:WAITING_SHOWN]:
            if r.status is RunStatus.QUEUED:
                print(f"  {r.run_id}  {r.queue['reason'] if r.queue else 'QUEUED'}")
            else:
                print(f"  {r.run_id}  RUNNING, its nodes wait for {r.waiting}")
        if len(waiting) > WAITING_SHOWN:
            print(f"  … and {len(waiting) - WAITING_SHOWN} more queued (`air get run ID` says why each waits)")


list_.add_command(get_pools, "pools")  # `air list pools` is `air get pools`: both read naturally
