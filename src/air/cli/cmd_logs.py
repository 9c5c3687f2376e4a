"""`air logs ID`: a run's node (or rank) logs of an attempt; follows an active run; --download-to copies them."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import click

from air.cli.complete import complete_run_id
from air.cli.main import common, settings
from air.cli.output import stderr
from air.errors import AirError, NotFoundError, UserInputError
from air.runs.follow import FollowEvent, Lines
from air.runs.paths import RunPaths
from air.runs.store import Run, RunStore
from air.runs.views import attempt_index, log_masker


@click.command()
@click.argument("run_id", shell_complete=complete_run_id)
@click.option(
    "--node",
    default=None,
    type=click.IntRange(min=0),
    help="Only this node's log (default: every node's, each line prefixed [node N]).",
)
@click.option(
    "--rank",
    default=None,
    type=click.IntRange(min=0),
    help="A @distributed call: only this rank's log (default: every rank's, prefixed [rank N]).",
)
@click.option(
    "--retry",
    "attempt",
    default=None,
    type=click.IntRange(min=0),
    help="Attempt, 0-based (default: the latest).",
)
@click.option(
    "--tail", default=None, type=click.IntRange(min=0),
    help="Only the last N lines of each log: per node (or rank), so --tail 4 on two nodes prints up to 8 "
    "(default: 10000 per log).",
)
@click.option(
    "--minutes", default=None, type=click.IntRange(min=1), metavar="N",
    help="Only the lines written in the last N minutes (to the second; from the line times air keeps beside "
    "each log). Not with --tail.",
)
@click.option(
    "--follow/--no-follow",
    "follow",
    default=None,
    help="Keep printing new lines until the run ends (the default for an active run); "
    "--no-follow prints what is there and exits.",
)
@click.option(
    "--download-to",
    "download_to",
    default=None,
    type=click.Path(file_okay=False),
    help="Copy every node's (a call: every rank's) log of the attempt to DIR/logs/, secret values masked.",
)
@common
def logs(
    run_id: str,
    node: int | None,
    rank: int | None,
    attempt: int | None,
    tail: int | None,
    minutes: int | None,
    follow: bool | None,
    download_to: str | None,
) -> None:
    """Print a run's logs: every node's (a workload) or rank's (a @distributed call); follows an active run."""
    from air.cli.remote import remote
    from air.cli.watch import print_follow, several_logs

    if minutes is not None and (tail is not None or download_to):
        raise UserInputError("--minutes chooses lines by time; it goes with neither --tail nor --download-to.",
                             hint=f"Use one: air logs {run_id} --minutes {minutes}   or   --tail N")
    since = None if minutes is None else time.time() - minutes * 60

    json_mode = settings().json
    client = remote()
    if client is not None:
        from air.cli.remote import follow_remote
        from air.runs.views import run_from_dict

        shown = client.get(f"/runs/{run_id}")
        run = run_from_dict(shown)
        if _a_sweep(run.id, bool(shown.get("is_sweep"))) or _never_started(run):
            return
        if download_to:
            listed = client.get(f"/runs/{run.id}/logs", attempt=attempt)
            target = Path(download_to) / "logs"
            target.mkdir(parents=True, exist_ok=True)
            for log in listed["logs"]:
                client.download(f"/runs/{run.id}/logs/{log['label']}/{log['index']}",
                                target / f"{log['label']}_{log['index']}.log", attempt=listed["attempt"])
            stderr(f"Copied {len(listed['logs'])} log(s) of attempt {listed['attempt']} to {target} "
                   "(secret values masked by the server)")
            return
        live = _follows(run, follow, attempt)
        events = follow_remote(client, run.id, node=node, rank=rank, attempt=attempt, tail=tail, live=live,
                               **({"minutes": minutes} if minutes is not None else {}))
        seen: set[tuple[str, int]] = set()
        last = print_follow(_noting(events, seen), json_mode=json_mode, prefixed=several_logs(run, node, rank))
        if minutes is not None:
            _say_none_since(minutes, seen)
        else:
            _say_empty(last or run, attempt, node, rank, seen, local=False)
        return
    from air.runs.follow import log_sources, logs_are_per_rank, snapshot_lines
    from air.runs.paths import CallPaths
    from air.runs.sweep import is_sweep_spec

    store = RunStore()
    run = store.get_run(run_id)
    if _a_sweep(run.id, is_sweep_spec(run.spec_yaml)) or _never_started(run):
        return
    if run.current_attempt is None and follow is False:
        raise NotFoundError(
            f"Run {run.id} has not started an attempt yet ({run.status.value}).",
            hint=f"Wait for it with: air logs {run.id} --follow",
        )
    shown_attempt = attempt_index(store, run, attempt)
    log_sources(run, shown_attempt, node=node, rank=rank)  # checks --node/--rank first
    mask = log_masker(run)  # before any line: fails closed when secrets cannot be resolved
    if download_to:
        mask("")  # resolves the values now: a copy is refused before any file is written
        target = Path(download_to) / "logs"
        target.mkdir(parents=True, exist_ok=True)
        found = (
            CallPaths(run.id).rank_logs()
            if logs_are_per_rank(run)
            else RunPaths(run.id).node_logs(shown_attempt)
        )
        label = "rank" if logs_are_per_rank(run) else "node"
        for n, path in found.items():
            _masked_copy(path, target / f"{label}_{n}.log", mask)
        stderr(f"Copied {len(found)} log(s) of attempt {shown_attempt} to {target} (secret values masked)")
        return
    if _follows(run, follow, attempt):
        from air.runs.follow import follow as follow_run

        events = follow_run(run.id, store=store, node=node, rank=rank, attempt=attempt, tail=tail, mask=mask,
                            since=since)
    else:
        events = iter(snapshot_lines(run, shown_attempt, node=node, rank=rank, tail=tail, mask=mask, since=since))
    printed: set[tuple[str, int]] = set()
    last = print_follow(_noting(events, printed), json_mode=json_mode, prefixed=several_logs(run, node, rank))
    if minutes is not None:
        _say_none_since(minutes, printed)
        return
    ended = last or store.get_run(run.id)
    _say_empty(ended, attempt_index(store, ended, attempt), node, rank, printed, local=True)


def _say_none_since(minutes: int, seen: set[tuple[str, int]]) -> None:
    """`--minutes` that matched nothing says so (on stderr), rather than printing nothing."""
    if not seen:
        stderr(f"(No log lines in the last {minutes} minute{'s' if minutes != 1 else ''}.)")


def _a_sweep(run_id: str, is_sweep: bool) -> bool:
    """A `for_each` sweep runs nothing itself: its tasks are runs with their own logs; say where."""
    if is_sweep:
        stderr(f"Run {run_id} is a for_each sweep: it has no logs of its own; each task is a run with its own "
               f"(air get run {run_id} lists them; then air logs TASK_RUN_ID)")
    return is_sweep


def _never_started(run: Run) -> bool:
    """A run that ended before any attempt (canceled while queued) has no log and never will: say so
    instead of "wait for it"."""
    if run.current_attempt is not None or not run.is_terminal:
        return False
    reason = f": {run.termination_reason}" if run.termination_reason else ""
    stderr(f"Run {run.id} never started, so it has no logs: it ended {run.status.value} before its first "
           f"attempt{reason}")
    return True


def _noting(events: Iterator[FollowEvent], seen: set[tuple[str, int]]) -> Iterator[FollowEvent]:
    """The events as they are, noting which logs gave at least one line."""
    for item in events:
        if isinstance(item, Lines) and item.lines:
            seen.add((item.source.label, item.source.index))
        yield item


def _say_empty(run: Run, attempt: int | None, node: int | None, rank: int | None, seen: set[tuple[str, int]],
               *, local: bool) -> None:
    """A log that printed nothing gets a line on stderr saying so and, on this machine, why: the node (or
    rank) has not started, or started and printed nothing. Silence would read as a broken `air logs`."""
    from air.runs.follow import log_sources

    shown = attempt if attempt is not None else (run.current_attempt or 0)
    try:
        sources = log_sources(run, shown, node=node, rank=rank)
    except AirError:
        return
    for source in sources:
        if (source.label, source.index) in seen:
            continue
        what = f"{source.label} {source.index}'s log of attempt {shown}"
        if not local:
            stderr(f"({what} is empty.)")
        elif source.path is None or not source.path.exists():
            stderr(f"({what} does not exist: that {source.label} "
                   + ("never started.)" if run.is_terminal else "has not started yet.)"))
        else:
            stderr(f"({what} is empty: the command started and printed nothing"
                   + (".)" if run.is_terminal else " yet.)"))


def _masked_copy(source: Path, target: Path, mask: Callable[[str], str]) -> None:
    """Copy a log line by line through `mask` (logs an older air wrote may hold values), byte for byte
    otherwise (surrogateescape keeps invalid UTF-8 as it was); the copy appears whole or not at all."""
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with open(source, encoding="utf-8", errors="surrogateescape", newline="") as src, \
                os.fdopen(fd, "w", encoding="utf-8", errors="surrogateescape", newline="") as out:
            for line in src:
                out.write(mask(line))
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _follows(run: Run, follow: bool | None, attempt: int | None) -> bool:
    """Like the hosted CLI and `sky logs`: an active run is followed unless --no-follow or an old attempt."""
    if follow is not None:
        return follow
    return not run.is_terminal and not (attempt is not None and attempt != run.current_attempt)
