"""Streaming a run's logs: `air run --watch` (status changes and every node's log until the run ends; the
exit code is the outcome) and `air logs ID --follow` (the same lines, without the status).

A workload's logs are per node (`runs/<id>/attempt_<a>/node_<n>.log`), a local `@distributed` call's per
rank (`calls/<id>/rank_<r>.log`). With more than one log, each line is prefixed `[node N]` / `[rank N]`
(in `--json`, the LOG event carries `node` or `rank` instead); `--node N` / `--rank N` narrow to one.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from air.cli.output import event, fmt_duration, stderr
from air.cli.output import status as say_status
from air.errors import NotFoundError, UserInputError
from air.runs.logtail import LineCursor
from air.runs.paths import CallPaths, RunPaths
from air.runs.states import RunStatus
from air.runs.store import Run, RunStore

if TYPE_CHECKING:
    from air.cli.waiting import WatchExtras

POLL_S = 0.2
RECONCILE_EVERY_S = 2.0


@dataclass(frozen=True)
class LogSource:
    """One log of a run: `label` "node" (workloads, remote calls) or "rank" (local calls), its index."""

    label: str
    index: int
    path: Path

    @property
    def prefix(self) -> str:
        return f"[{self.label} {self.index}] "


def logs_are_per_rank(run: Run, rank: int | None = None) -> bool:
    """A local call's logs are its ranks' (it has one node); a remote call's are its nodes', unless a
    rank is asked for (its rank logs are in the call folder when the cluster shares this file system)."""
    return run.kind == "call" and (run.backend == "local" or rank is not None)


def log_sources(
    run: Run, attempt: int, *, node: int | None = None, rank: int | None = None
) -> list[LogSource]:
    """The logs `air logs` / `--watch` show for `attempt`: every node's (or rank's), or the one asked for.
    A --node/--rank that does not fit the run is a NotFoundError / UserInputError saying what does."""
    if logs_are_per_rank(run, rank):
        world = run.num_accelerators
        if node is not None and run.backend == "local":
            raise UserInputError(
                f"Run {run.id} is a local @distributed call: its logs are per rank, not per node.",
                hint=f"Use --rank N (ranks 0 to {world - 1}): air logs {run.id} --rank 0",
            )
        if rank is not None and not 0 <= rank < world:
            raise NotFoundError(
                f"Run {run.id} has {world} rank(s); there is no rank {rank}.",
                hint=f"Ranks are numbered 0 to {world - 1}.",
            )
        paths = CallPaths(run.id)
        return [
            LogSource("rank", r, paths.rank_log(r)) for r in ([rank] if rank is not None else range(world))
        ]
    if rank is not None:
        raise UserInputError(
            f"Run {run.id} is a workload: its logs are per node, not per rank.",
            hint=f"Use --node N (nodes 0 to {run.num_nodes - 1}): air logs {run.id} --node 0",
        )
    if node is not None and not 0 <= node < run.num_nodes:
        raise NotFoundError(
            f"Run {run.id} has {run.num_nodes} node(s); there is no node {node}.",
            hint=f"Nodes are numbered 0 to {run.num_nodes - 1}.",
        )
    run_paths = RunPaths(run.id)
    return [
        LogSource("node", n, run_paths.node_log(attempt, n))
        for n in ([node] if node is not None else range(run.num_nodes))
    ]


class LogPrinter:
    """Writes lines of some logs to stdout: prefixed when there is more than one, or as LOG events."""

    def __init__(
        self,
        sources: Sequence[LogSource],
        *,
        json_mode: bool,
        mask: Callable[[str], str],
        attempt: int | None = None,
    ) -> None:
        self.sources = list(sources)
        self.json_mode = json_mode
        self.mask = mask
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


class _Streamer(LogPrinter):
    """Every source's new lines, one cursor each."""

    def __init__(
        self,
        sources: Sequence[LogSource],
        *,
        json_mode: bool,
        mask: Callable[[str], str],
        attempt: int | None,
        tail: int | None,
    ) -> None:
        super().__init__(sources, json_mode=json_mode, mask=mask, attempt=attempt)
        self.cursors = [(source, LineCursor(source.path)) for source in self.sources]
        if tail is not None:
            for source, cursor in self.cursors:
                self.emit(source, cursor.start_at_tail(tail))

    def pump(self, final: bool = False) -> None:
        for source, cursor in self.cursors:
            lines = cursor.read(final=final)
            if lines:
                self.emit(source, lines)


def stream_run(
    run_id: str,
    *,
    json_mode: bool,
    store: RunStore | None = None,
    node: int | None = None,
    rank: int | None = None,
    attempt: int | None = None,
    tail: int | None = None,
    mask: Callable[[str], str] | None = None,
    on_run: Callable[[Run], None] | None = None,
    attempt_in_events: bool = True,
) -> Run:
    """Print the run's log lines as they are written until it ends; return it as it ended.

    Follows the current attempt (and the next one after a retry), unless `attempt` pins one: then it
    stops when that attempt is no longer the current one. `on_run` sees the run at every poll (status
    lines of `--watch`). Runs whose supervisor died are ended meanwhile (reconcile), so this ends too.
    """
    from air.runs.reconcile import reconcile

    store = store or RunStore()
    mask = mask or (lambda text: text)
    current: int | None = None
    streamer: _Streamer | None = None
    last_reconcile = time.monotonic()
    while True:
        run = store.get_run(run_id)
        if (
            run.current_attempt is not None
            and run.current_attempt != current
            and (attempt is None or current is None)
        ):
            if streamer is not None:
                streamer.pump(final=True)
                if json_mode:
                    event(
                        "RETRY",
                        **({"node": node} if node is not None else {}),
                        attempt=run.current_attempt,
                        previous_attempt=current,
                    )
                else:
                    say_status(f"--- attempt {run.current_attempt} (retry {run.current_attempt} of the run) ---")
            current = attempt if attempt is not None else run.current_attempt
            streamer = _Streamer(
                log_sources(run, current, node=node, rank=rank),
                json_mode=json_mode,
                mask=mask,
                attempt=current if attempt_in_events else None,
                tail=tail,
            )
        if on_run is not None:
            on_run(run)
        done = run.is_terminal or (attempt is not None and run.current_attempt not in (None, attempt))
        if streamer is not None:
            streamer.pump(final=done)
        if done:
            return run
        if time.monotonic() - last_reconcile > RECONCILE_EVERY_S:
            reconcile(store)
            last_reconcile = time.monotonic()
        time.sleep(POLL_S)


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
    extras = WatchExtras(run_id, json_mode=json_mode, verbose=verbose, store=store)
    try:
        return _watch(run_id, json_mode=json_mode, store=store, node=node, masker=masker, extras=extras)
    finally:
        extras.close()


def _watch(
    run_id: str,
    *,
    json_mode: bool,
    store: RunStore,
    node: int | None,
    masker: Callable[[str], str] | None,
    extras: WatchExtras,
) -> int:
    shown: list[RunStatus | None] = [None]

    def on_run(run: Run) -> None:
        extras.read_supervisor_log()
        show_status(run)
        extras.poll(run)

    def show_status(run: Run) -> None:
        status = shown[0]
        if run.status == status:
            return
        if json_mode:
            event(
                "STATUS",
                status=run.status.value,
                previous_status=status.value if status else None,
                reason=run.termination_reason,
            )
        else:
            extra = (
                f": {run.termination_reason}"
                if run.termination_reason
                and run.status not in (RunStatus.RUNNING, RunStatus.SUCCESS, RunStatus.QUEUED)
                else ""
            )
            say_status(f"[{run_id}] {run.status.value}{extra}")
        shown[0] = run.status

    run = stream_run(
        run_id,
        json_mode=json_mode,
        store=store,
        node=node,
        mask=masker,
        on_run=on_run,
        attempt_in_events=False,
    )
    duration = run.duration_seconds()
    if json_mode:
        event(
            "TERMINAL",
            status=run.status.value,
            duration_seconds=duration,
            reason=run.termination_reason,
            attempts=run.attempt_count,
        )
    else:
        # A failure is an error (shown even with -q); a success is a status line.
        (say_status if run.status is RunStatus.SUCCESS else stderr)(
            f"[{run_id}] ended {run.status.value} after {fmt_duration(duration)}"
            + (f" ({run.attempt_count} attempts)" if run.attempt_count > 1 else "")
            + (f": {run.termination_reason}" if run.termination_reason and run.status.is_failure() else "")
        )
    return 0 if run.status is RunStatus.SUCCESS else 1
