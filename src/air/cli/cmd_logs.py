"""`air logs ID`: a run's node (or rank) logs of an attempt; follows an active run; --download-to copies them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import click

from air.cli.complete import complete_run_id
from air.cli.main import common, settings
from air.cli.output import stderr
from air.errors import AirError, NotFoundError, UserInputError
from air.views.follow import log_sources
from air.wire import LinesEvent, Run

if TYPE_CHECKING:
    from air.cli.watch import Event
    from air.client.sdk import Client


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
    from air.cli.watch import print_follow
    from air.client.sdk import Client

    if minutes is not None and (tail is not None or download_to):
        raise UserInputError("--minutes chooses lines by time; it goes with neither --tail nor --download-to.",
                             hint=f"Use one: air logs {run_id} --minutes {minutes}   or   --tail N")
    client = Client(profile=settings().profile)  # this machine's runs, or a server's: one path for both
    run = client.get(run_id)
    if _a_sweep(run.id, run.is_sweep) or _never_started(run):
        return
    if run.attempt_number is None and follow is False:
        raise NotFoundError(
            f"Run {run.id} has not started an attempt yet ({run.status.value}).",
            hint=f"Wait for it with: air logs {run.id} --follow",
        )
    # Checks --node/--rank before anything is read or written.
    sources = log_sources(run, attempt if attempt is not None else run.attempt_number or 0, node=node, rank=rank)
    if download_to:
        copied = client.download_logs(run.id, download_to, attempt)
        stderr(f"Copied {len(copied.logs)} log(s) of attempt {copied.attempt} to {Path(download_to) / 'logs'} "
               "(secret values masked)")
        return
    events = client.events(run.id, live=_follows(run, follow, attempt), node=node, rank=rank, attempt=attempt,
                           tail=tail, minutes=minutes)
    seen: set[tuple[str, int]] = set()
    last = print_follow(_noting(events, seen), json_mode=settings().json, prefixed=len(sources) > 1)
    if minutes is not None:
        _say_none_since(minutes, seen)
        return
    if tail == 0:  # `tail -n 0`: nothing asked for, nothing printed, and no word that the log is empty
        return
    shown_attempt = attempt if attempt is not None else (last or run).attempt_number or 0
    _say_empty(client, run, shown_attempt, node, rank, seen, ended=last.is_terminal if last else run.is_terminal)


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
    if run.attempt_number is not None or not run.is_terminal:
        return False
    reason = f": {run.termination_reason}" if run.termination_reason else ""
    stderr(f"Run {run.id} never started, so it has no logs: it ended {run.status.value} before its first "
           f"attempt{reason}")
    return True


def _noting(events: Iterator[Event], seen: set[tuple[str, int]]) -> Iterator[Event]:
    """The events as they are, noting which logs gave at least one line."""
    for item in events:
        if isinstance(item, LinesEvent) and item.lines:
            seen.add((item.label, item.index))
        yield item


def _say_empty(client: Client, run: Run, attempt: int, node: int | None, rank: int | None,
               seen: set[tuple[str, int]], *, ended: bool) -> None:
    """A log that printed nothing gets a line on stderr saying so and why: the node (or rank) has not
    started, or started and printed nothing. Silence would read as a broken `air logs`."""
    try:
        unseen = [s for s in log_sources(run, attempt, node=node, rank=rank) if (s.label, s.index) not in seen]
        written = {(log.label, log.index) for log in client.log_list(run.id, attempt).logs} if unseen else set()
    except AirError:
        return
    for source in unseen:
        what = f"{source.label} {source.index}'s log of attempt {attempt}"
        if (source.label, source.index) not in written:
            stderr(f"({what} does not exist: that {source.label} "
                   + ("never started.)" if ended else "has not started yet.)"))
        else:
            stderr(f"({what} is empty: the command started and printed nothing" + (".)" if ended else " yet.)"))


def _follows(run: Run, follow: bool | None, attempt: int | None) -> bool:
    """Like the hosted CLI and `sky logs`: an active run is followed unless --no-follow or an old attempt."""
    if follow is not None:
        return follow
    return not run.is_terminal and not (attempt is not None and attempt != run.attempt_number)
