"""Streaming a run's logs: `air run --watch` (status changes and every node's log until the run ends; the
exit code is the outcome) and `air logs ID --follow` (the same lines, without the status).

Both print the events `air.Client.follow` yields, so a run on this machine and one on an air server are
printed by the same code. With more than one log, each line is prefixed `[node N]` / `[rank N]` (in
`--json`, the LOG event carries `node` or `rank` instead); `--node N` / `--rank N` narrow to one.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from air.cli.output import event, stderr
from air.cli.output import status as say_status
from air.store.states import RunStatus
from air.views.query import duration_text
from air.wire import LinesEvent, NewAttemptEvent, Run, RunEvent, SkippedEvent

if TYPE_CHECKING:
    from air.client.sdk import Client

#: What `air.Client.follow` yields.
Event = RunEvent | LinesEvent | NewAttemptEvent | SkippedEvent


def print_follow(
    events: Iterable[Event],
    *,
    json_mode: bool,
    prefixed: bool,
    node: int | None = None,
    on_run: Callable[[Run], None] | None = None,
    attempt_in_events: bool = True,
) -> Run | None:
    """Print a followed run's lines and return the run as it was last seen. `prefixed`: more than one
    log, so lines carry `[node N]`."""
    last: Run | None = None
    for item in events:
        if isinstance(item, RunEvent):
            last = item.run
            if on_run is not None:
                on_run(item.run)
        elif isinstance(item, LinesEvent):
            for line in item.lines:
                if json_mode:
                    extra = {"attempt": item.attempt} if attempt_in_events and item.attempt is not None else {}
                    event("LOG", **{item.label: item.index}, **extra, line=line)
                else:
                    sys.stdout.write((f"[{item.label} {item.index}] " if prefixed else "") + line + "\n")
            sys.stdout.flush()
        elif isinstance(item, NewAttemptEvent):
            if json_mode:
                event("RETRY", **({"node": node} if node is not None else {}), attempt=item.new_attempt,
                      previous_attempt=item.previous)
            else:
                say_status(f"--- attempt {item.new_attempt} (retry {item.new_attempt} of the run) ---")
        else:  # this follower fell behind the run's output: said, not silent
            stderr(f"air: {item.skipped} line(s) skipped: this follower read more slowly than the run wrote "
                   "(air logs ID shows them).")
    return last


def watch(client: Client, run_id: str, *, json_mode: bool, node: int | None = None, verbose: int = 0) -> int:
    """`air run --watch`: status changes and every node's log (or `node`'s) until the run ends, then the
    outcome; returns the exit code (0 SUCCESS, 1 otherwise). Also says why a queued run waits, spins while
    nothing else moves (TTY only) and, with -v, streams the supervisor's log (on this machine: through a
    server it is there)."""
    from air.cli.waiting import WatchExtras

    run = client.get(run_id)
    run_id = run.run_id
    extras = WatchExtras(client, run_id, json_mode=json_mode, verbose=verbose)
    shown: list[RunStatus | None] = [None]

    def on_run(seen: Run) -> None:
        extras.read_supervisor_log()
        show_status(seen)
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

    try:
        prefixed = node is None and run.num_nodes > 1
        if run.is_sweep:
            last = _print_sweep(client, run_id, json_mode=json_mode, prefixed=prefixed, node=node, on_run=on_run)
        else:
            last = print_follow(client.follow(run_id, node=node), json_mode=json_mode, prefixed=prefixed, node=node,
                                on_run=on_run, attempt_in_events=False)
        ended: Run = last or run
        duration = ended.duration_seconds
        if json_mode:
            event("TERMINAL", status=ended.status.value, duration_seconds=duration,
                  reason=ended.termination_reason, attempts=ended.attempts)
        else:
            # A failure is an error (shown even with -q); a success is a status line.
            (say_status if ended.status is RunStatus.SUCCESS else stderr)(
                f"[{run_id}] ended {ended.status.value} after {duration_text(duration)}"
                + (f" ({ended.attempts} attempts)" if ended.attempts > 1 else "")
                + (f": {ended.termination_reason}" if ended.termination_reason and ended.status.is_failure()
                   else "")
            )
        return 0 if ended.status is RunStatus.SUCCESS else 1
    finally:
        extras.close()


def _print_sweep(client: Client, run_id: str, *, json_mode: bool, prefixed: bool, node: int | None,
                 on_run: Callable[[Run], None]) -> Run | None:
    """A sweep's watch: the parent as any run, and its children too: a line when a child's state changes
    (`[PARENT] task N CHILD: STATUS`) and each child's lines prefixed `[task N]` (`[task N node M]` when it
    has several nodes); in --json, STATUS and LOG events that carry `task` and `run_id`."""
    from air.cli.sweep_follow import Child, follow_sweep

    last: Run | None = None
    shown: dict[str, RunStatus] = {}
    nodes: dict[str, int] = {}

    def child_run(child: Child, seen: Run) -> None:
        nodes[child.run_id] = seen.num_nodes
        before = shown.get(child.run_id)
        if seen.status == before:
            return
        shown[child.run_id] = seen.status
        if json_mode:
            event("STATUS", task=child.index, run_id=child.run_id, status=seen.status.value,
                  previous_status=before.value if before else None, reason=seen.termination_reason)
            return
        reason = seen.termination_reason if seen.termination_reason and seen.status.is_failure() else None
        say_status(f"[{run_id}] task {child.index} {child.run_id}: {seen.status.value}"
                   + (f": {reason}" if reason else ""))

    def child_error(child: Child, error: BaseException) -> None:
        stderr(f"air: stopped following task {child.index} ({child.run_id}): {error}")

    for child, item in follow_sweep(client, run_id, node=node, on_child_error=child_error):
        if child is None:
            seen = print_follow([item], json_mode=json_mode, prefixed=prefixed, node=node, on_run=on_run,
                                attempt_in_events=False)
            last = seen or last
        elif isinstance(item, RunEvent):
            child_run(child, item.run)
        elif isinstance(item, LinesEvent):
            several = node is None and nodes.get(child.run_id, 1) > 1
            where = f"task {child.index}" + (f" {item.label} {item.index}" if several else "")
            for line in item.lines:
                if json_mode:
                    event("LOG", task=child.index, run_id=child.run_id, **{item.label: item.index},
                          attempt=item.attempt, line=line)
                else:
                    sys.stdout.write(f"[{where}] {line}\n")
            sys.stdout.flush()
        elif isinstance(item, NewAttemptEvent):
            if json_mode:
                event("RETRY", task=child.index, run_id=child.run_id, attempt=item.new_attempt,
                      previous_attempt=item.previous)
            else:
                say_status(f"[task {child.index}] --- attempt {item.new_attempt} of {child.run_id} ---")
        else:
            print_follow([item], json_mode=json_mode, prefixed=prefixed)
    return last
