"""Streaming a run's logs: `air run --watch` (status changes and every node's log until the run ends; the
exit code is the outcome) and `air logs ID --follow` (the same lines, without the status).

A workload's logs are per node (`runs/<id>/attempt_<a>/node_<n>.log`), a local `@distributed` call's per
rank (`calls/<id>/rank_<r>.log`). With more than one log, each line is prefixed `[node N]` / `[rank N]`
(in `--json`, the LOG event carries `node` or `rank` instead); `--node N` / `--rank N` narrow to one.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from air.cli.output import event, stderr
from air.cli.output import status as say_status
from air.runs.follow import FollowEvent, Lines, LogSource, NewAttempt, follow
from air.runs.states import RunStatus
from air.runs.store import Run, RunStore
from air.runs.views import duration_text

if TYPE_CHECKING:
    from air.cli.waiting import WatchExtras


class LogPrinter:
    """Writes lines of some logs to stdout: prefixed when there is more than one, or as LOG events."""

    def __init__(
        self,
        sources: Sequence[LogSource],
        *,
        json_mode: bool,
        mask: Callable[[str], str] | None = None,
        attempt: int | None = None,
    ) -> None:
        self.sources = list(sources)
        self.json_mode = json_mode
        self.mask = mask or (lambda text: text)
        self.attempt = attempt
        self.prefixed = len(self.sources) > 1

    def emit(self, source: LogSource, lines: Sequence[str]) -> None:
        for line in lines:
            line = self.mask(line)
            if self.json_mode:
                extra = {} if self.attempt is None else {"attempt": self.attempt}
                event("LOG", **{source.label: source.index}, **extra, line=line)
            else:
                sys.stdout.write((source.prefix if self.prefixed else "") + line + "\n")
        sys.stdout.flush()


def print_follow(
    events: Iterable[FollowEvent],
    *,
    json_mode: bool,
    prefixed: bool,
    node: int | None = None,
    on_run: Callable[[Run], None] | None = None,
    attempt_in_events: bool = True,
) -> Run | None:
    """Print a followed run's lines (from this machine's store or from a server: the same events) and
    return the run as it was last seen. `prefixed`: more than one log, so lines carry `[node N]`."""
    last: Run | None = None
    for item in events:
        if isinstance(item, Run):
            last = item
            if on_run is not None:
                on_run(item)
        elif isinstance(item, Lines):
            printer = LogPrinter([item.source] * (2 if prefixed else 1), json_mode=json_mode,
                                 attempt=item.attempt if attempt_in_events else None)
            printer.emit(item.source, item.lines)
        elif isinstance(item, NewAttempt):
            if json_mode:
                event("RETRY", **({"node": node} if node is not None else {}), attempt=item.attempt,
                      previous_attempt=item.previous)
            else:
                say_status(f"--- attempt {item.attempt} (retry {item.attempt} of the run) ---")
    return last


def several_logs(run: Run, node: int | None, rank: int | None) -> bool:
    """Whether following shows more than one log (then each line is prefixed)."""
    from air.runs.follow import logs_are_per_rank

    if node is not None or rank is not None:
        return False
    return (run.num_accelerators if logs_are_per_rank(run) else run.num_nodes) > 1


def watch(
    run_id: str,
    *,
    json_mode: bool,
    store: RunStore | None = None,
    node: int | None = None,
    masker: Callable[[str], str] | None = None,
    verbose: int = 0,
) -> int:
    """Stream status and every node's log (or `node`'s) until terminal; 0 for SUCCESS, 1 otherwise.
    Also says why a queued run waits, spins while nothing else moves (TTY only) and, with -v, streams
    the supervisor's log."""
    from air.cli.waiting import WatchExtras

    store = store or RunStore()
    run = store.get_run(run_id)
    extras = WatchExtras(run.id, json_mode=json_mode, verbose=verbose, store=store)
    try:
        events = follow(run.id, store=store, node=node, mask=masker)
        return watch_events(run, events, json_mode=json_mode, node=node, extras=extras)
    finally:
        extras.close()


def watch_events(
    run: Run,
    events: Iterable[FollowEvent],
    *,
    json_mode: bool,
    node: int | None,
    extras: WatchExtras | None = None,
) -> int:
    """`--watch`'s output for a followed run (from this machine or from a server): status changes, lines,
    and the outcome; returns the exit code (0 SUCCESS, 1 otherwise)."""
    run_id = run.id
    shown: list[RunStatus | None] = [None]

    def on_run(seen: Run) -> None:
        if extras is not None:
            extras.read_supervisor_log()
        show_status(seen)
        if extras is not None:
            extras.poll(seen)

    def show_status(seen: Run) -> None:
        status = shown[0]
        if seen.status == status:
            return
        if json_mode:
            event("STATUS", status=seen.status.value, previous_status=status.value if status else None,
                  reason=seen.termination_reason)
        else:
            extra = (
                f": {seen.termination_reason}"
                if seen.termination_reason
                and seen.status not in (RunStatus.RUNNING, RunStatus.SUCCESS, RunStatus.QUEUED)
                else ""
            )
            say_status(f"[{run_id}] {seen.status.value}{extra}")
        shown[0] = seen.status

    last = print_follow(events, json_mode=json_mode, prefixed=several_logs(run, node, None), node=node,
                        on_run=on_run, attempt_in_events=False)
    run = last or run
    duration = run.duration_seconds()
    if json_mode:
        event("TERMINAL", status=run.status.value, duration_seconds=duration, reason=run.termination_reason,
              attempts=run.attempt_count)
    else:
        # A failure is an error (shown even with -q); a success is a status line.
        (say_status if run.status is RunStatus.SUCCESS else stderr)(
            f"[{run_id}] ended {run.status.value} after {duration_text(duration)}"
            + (f" ({run.attempt_count} attempts)" if run.attempt_count > 1 else "")
            + (f": {run.termination_reason}" if run.termination_reason and run.status.is_failure() else "")
        )
    return 0 if run.status is RunStatus.SUCCESS else 1
