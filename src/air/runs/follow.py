"""Following a run: which logs it has, and a stream of what happens to it (its state at every poll, new log
lines, a new attempt) until it ends.

`air run --watch` and `air logs --follow` print this stream; `air server` sends the same stream over HTTP
to a remote CLI, which prints it with the same code. Secret values are masked here, where the secrets are.

A workload's logs are per node (`runs/<id>/attempt_<a>/node_<n>.log`), a local `@distributed` call's per
rank (`calls/<id>/rank_<r>.log`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from air.errors import NotFoundError, UserInputError
from air.runs.logtail import LineCursor, lines_since, tail_lines
from air.runs.paths import CallPaths, RunPaths
from air.runs.store import Run, RunStore

POLL_S = 0.2
RECONCILE_EVERY_S = 2.0
#: Lines `air logs` shows of a log when no --tail is given.
DEFAULT_TAIL = 10000


@dataclass(frozen=True)
class LogSource:
    """One log of a run: `label` "node" (workloads, remote calls) or "rank" (local calls), its index.
    `path` is None on a client that reads the log through a server."""

    label: str
    index: int
    path: Path | None = None

    @property
    def prefix(self) -> str:
        return f"[{self.label} {self.index}] "


@dataclass(frozen=True)
class Lines:
    """New lines of one log (already masked), of attempt `attempt`."""

    source: LogSource
    lines: list[str]
    attempt: int | None = None


@dataclass(frozen=True)
class NewAttempt:
    """The run moved on to another attempt (a retry): the lines that follow are that attempt's."""

    attempt: int
    previous: int | None


#: What following a run yields: the run as it is now (every poll), lines, or a new attempt.
FollowEvent = Run | Lines | NewAttempt


def logs_are_per_rank(run: Run, rank: int | None = None) -> bool:
    """A local call's logs are its ranks' (it has one node); a remote call's are its nodes', unless a
    rank is asked for (its rank logs are in the call folder when the cluster shares this file system)."""
    return run.kind == "call" and (run.backend == "local" or rank is not None)


def log_sources(run: Run, attempt: int, *, node: int | None = None, rank: int | None = None) -> list[LogSource]:
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
        return [LogSource("rank", r, paths.rank_log(r, attempt)) for r in ([rank] if rank is not None else range(world))]
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


def _masked(source: LogSource, lines: list[str], mask: Callable[[str], str], attempt: int | None) -> Lines:
    return Lines(source, [mask(line) for line in lines], attempt)


def snapshot_lines(
    run: Run, attempt: int, *, node: int | None, rank: int | None, tail: int | None, mask: Callable[[str], str],
    since: float | None = None,
) -> list[Lines]:
    """`air logs` without following: the last lines of each log of `attempt` that exists (with `since`,
    only those written from then on: `--minutes`). NotFoundError when none does."""
    sources = log_sources(run, attempt, node=node, rank=rank)
    present = [s for s in sources if s.path is not None and s.path.exists()]
    if not present:
        what = f"{sources[0].label} {sources[0].index}" if len(sources) == 1 else "any node or rank"
        raise NotFoundError(
            f"No log for {what} of attempt {attempt} of run {run.id}"
            + (f" ({run.status.value})." if run.is_terminal else " yet.")
        )
    limit = tail if tail is not None else DEFAULT_TAIL
    return [_masked(s, tail_lines(s.path, limit) if since is None else lines_since(s.path, since, limit), mask, attempt)
            for s in present if s.path is not None]


def follow(
    run_id: str,
    *,
    store: RunStore,
    node: int | None = None,
    rank: int | None = None,
    attempt: int | None = None,
    tail: int | None = None,
    mask: Callable[[str], str] | None = None,
    since: float | None = None,
) -> Iterator[FollowEvent]:
    """The run's log lines as they are written, until it ends; the last run it yields is the run as it ended.

    Follows the current attempt (and the next one after a retry), unless `attempt` pins one: then it
    stops when that attempt is no longer the current one. Runs whose supervisor died are ended
    meanwhile (reconcile), so this ends too.
    """
    from air.runs.reconcile import reconcile

    mask = mask or (lambda text: text)
    current: int | None = None
    cursors: list[tuple[LogSource, LineCursor]] | None = None
    last_reconcile = time.monotonic()
    started_at_time = False

    def pump(final: bool) -> Iterator[Lines]:
        for source, cursor in cursors or []:
            lines = cursor.read(final=final)
            if lines:
                yield _masked(source, lines, mask, current)

    while True:
        run = store.get_run(run_id)
        if run.current_attempt is not None and run.current_attempt != current and (attempt is None or current is None):
            if cursors is not None:
                yield from pump(final=True)
                yield NewAttempt(run.current_attempt, current)
            current = attempt if attempt is not None else run.current_attempt
            cursors = [(s, LineCursor(s.path)) for s in log_sources(run, current, node=node, rank=rank)
                       if s.path is not None]
            if since is not None and not started_at_time:
                started_at_time = True  # the first attempt followed starts at `since`; a retry from its start
                for _, cursor in cursors:
                    cursor.start_at_time(since)
            elif tail is not None:
                for source, cursor in cursors:
                    lines = cursor.start_at_tail(tail)
                    if lines:
                        yield _masked(source, lines, mask, current)
        done = run.is_terminal or (attempt is not None and run.current_attempt not in (None, attempt))
        yield run
        yield from pump(final=done)
        if done:
            return
        if time.monotonic() - last_reconcile > RECONCILE_EVERY_S:
            reconcile(store)
            last_reconcile = time.monotonic()
        time.sleep(POLL_S)


__all__ = ["FollowEvent", "Lines", "LogSource", "NewAttempt", "follow", "log_sources", "logs_are_per_rank",
           "snapshot_lines"]
