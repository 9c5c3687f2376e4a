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
from typing import Protocol

from air.errors import NotFoundError, UserInputError
from air.store.paths import CallPaths, RunPaths
from air.store.run_store import Run, RunStore
from air.views.logtail import LineCursor, lines_since, tail_lines

#: How often a follow looks for new lines and state (a store read and a stat of each log).
POLL_S = 0.1
RECONCILE_EVERY_S = 2.0
#: How many times `Following.join` reads on to meet the follow's position in a log that keeps growing.
JOIN_ROUNDS = 1000
#: Blocks (logtail.READ_BYTES each) a follow reads of one log per step at most; the rest at the next step.
#: Two (1 MiB): a MiB of 2-byte lines is already half a million strings (~30 MB) held by one step.
STEP_BLOCKS = 2
#: Lines `air logs` shows of a log when no --tail is given.
DEFAULT_TAIL = 10000


@dataclass(frozen=True)
class LogSource:
    """One log of a run: `label` "node" (workloads, remote calls) or "rank" (local calls), its index.
    `path` is None on a client that reads the log through a server."""

    label: str
    index: int
    path: Path | None = None


@dataclass(frozen=True)
class Lines:
    """New lines of one log (already masked), of attempt `attempt`."""

    source: LogSource
    lines: list[str]
    attempt: int | None = None
    #: The byte offset in the log just after these lines: where a reader that stops here resumes (a page's
    #: Last-Event-ID). None where not known.
    resume_at: int | None = None


@dataclass(frozen=True)
class NewAttempt:
    """The run moved on to another attempt (a retry): the lines that follow are that attempt's."""

    attempt: int
    previous: int | None


#: What following a run yields: the run as it is now (every poll), lines, or a new attempt.
FollowEvent = Run | Lines | NewAttempt


class RunShape(Protocol):
    """What `log_sources` reads of a run: a store `Run`, or the API's (air.wire.Run)."""

    @property
    def id(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def backend(self) -> str: ...
    @property
    def num_nodes(self) -> int: ...
    @property
    def num_accelerators(self) -> int: ...


def logs_are_per_rank(run: RunShape, rank: int | None = None) -> bool:
    """A local call's logs are its ranks' (it has one node); a remote call's are its nodes', unless a
    rank is asked for (its rank logs are in the call folder when the cluster shares this file system)."""
    return run.kind == "call" and (run.backend == "local" or rank is not None)


def log_sources(run: RunShape, attempt: int, *, node: int | None = None, rank: int | None = None) -> list[LogSource]:
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


def _masked(source: LogSource, lines: list[str], mask: Callable[[str], str], attempt: int | None,
            cursor: LineCursor | None = None) -> Lines:
    return Lines(source, [mask(line) for line in lines], attempt, None if cursor is None else cursor.resume_offset)


def _read_on(cursor: LineCursor, final: bool, limit: int | None = None) -> list[str]:
    """What a cursor reads now, one bounded block after another: all there is, or (`limit`) at most that
    many blocks (the rest at the next step, so that one step stays short)."""
    lines = cursor.read(final=final)
    blocks = 1
    while cursor.behind and (limit is None or blocks < limit):
        lines += cursor.read(final=final)
        blocks += 1
    return lines


def attempt_index(store: RunStore, run: Run, attempt: int | None) -> int:
    """The attempt whose logs `air logs`/the API read: `attempt`, else the current one (0 before any)."""
    return store.get_attempt(run.id, attempt).index if run.current_attempt is not None else 0


def snapshot(
    store: RunStore, run: Run, attempt: int | None, *, node: int | None, rank: int | None, tail: int | None,
    mask: Callable[[str], str], since: float | None = None,
) -> list[FollowEvent]:
    """`air logs` without following (on this machine or through a server): the run, then the last lines
    of each log of `attempt` (default: the latest) that exists (with `since`, only those written from then
    on: `--minutes`). NotFoundError when none does."""
    attempt = attempt_index(store, run, attempt)
    sources = log_sources(run, attempt, node=node, rank=rank)
    present = [s for s in sources if s.path is not None and s.path.exists()]
    if not present:
        what = f"{sources[0].label} {sources[0].index}" if len(sources) == 1 else "any node or rank"
        raise NotFoundError(
            f"No log for {what} of attempt {attempt} of run {run.id}"
            + (f" ({run.status.value})." if run.is_terminal else " yet.")
        )
    limit = tail if tail is not None else DEFAULT_TAIL
    return [run, *(_masked(s, tail_lines(s.path, limit) if since is None else lines_since(s.path, since, limit),
                           mask, attempt) for s in present if s.path is not None)]


class Following:
    """One follow of a run, one poll at a time: `step()` reads the run and the lines appended since the last
    step. `follow` loops over it here; `air server` runs one per followed run and fans its events out to
    every follower (air.server.fanout), where `join` starts a newcomer exactly at its position.

    Follows the current attempt (and the next one after a retry), unless `attempt` pins one: then it is
    `done` when that attempt is no longer the current one. `tail` starts every attempt followed at its last
    `tail` lines, `since` the first one at the lines written from then on; `from_end` starts an attempt
    that is already under way at the first step at its end (a server's reader: followers catch up with
    `join`). Otherwise an attempt is followed from its first line.
    """

    def __init__(self, run_id: str, *, store: RunStore, node: int | None = None, rank: int | None = None,
                 attempt: int | None = None, tail: int | None = None, mask: Callable[[str], str] | None = None,
                 since: float | None = None, from_end: bool = False) -> None:
        self.run_id, self.store, self.node, self.rank, self.attempt = run_id, store, node, rank, attempt
        self.tail, self.since, self.from_end = tail, since, from_end
        self.mask: Callable[[str], str] = mask or (lambda text: text)
        self.current: int | None = None
        self.cursors: list[tuple[LogSource, LineCursor]] | None = None
        self.run: Run | None = None
        self.done = False
        self._first_step = True
        self._started_at_time = False
        self._last_reconcile = time.monotonic()

    @property
    def behind(self) -> bool:
        """Some log has more than the last step read: step again without waiting."""
        return any(cursor.behind for _, cursor in self.cursors or [])

    def _pump(self, final: bool) -> list[Lines]:
        out = []
        for source, cursor in self.cursors or []:
            # bounded also when final: `step` stays not `done` while a log is `behind` (memory, issue 25)
            lines = _read_on(cursor, final, STEP_BLOCKS)
            if lines:
                out.append(_masked(source, lines, self.mask, self.current, cursor))
        return out

    def step(self) -> list[FollowEvent]:
        """One poll: a new attempt's start (the old one's last lines, `NewAttempt`), the run as it is now,
        the lines appended since. After the step that sets `done`, there is nothing more to read."""
        from air.runs.reconcile import reconcile

        first_step, self._first_step = self._first_step, False
        events: list[FollowEvent] = []
        run = self.store.get_run(self.run_id)
        if (run.current_attempt is not None and run.current_attempt != self.current
                and (self.attempt is None or self.current is None)):
            if self.cursors is not None:
                events += self._pump(final=True)
                while self.behind:  # the old attempt's log has ended: read it to its end first
                    events += self._pump(final=True)
                events.append(NewAttempt(run.current_attempt, self.current))
            self.current = self.attempt if self.attempt is not None else run.current_attempt
            self.cursors = [(s, LineCursor(s.path))
                            for s in log_sources(run, self.current, node=self.node, rank=self.rank)
                            if s.path is not None]
            if self.since is not None and not self._started_at_time:
                self._started_at_time = True  # the first attempt followed starts at `since`; a retry from its start
                for _, cursor in self.cursors:
                    cursor.start_at_time(self.since)
            elif self.tail is not None or (self.from_end and first_step):
                for source, cursor in self.cursors:
                    lines = cursor.start_at_tail(self.tail if self.tail is not None else 0)
                    if lines:
                        events.append(_masked(source, lines, self.mask, self.current, cursor))
        self.done = run.is_terminal or (self.attempt is not None and run.current_attempt not in (None, self.attempt))
        self.run = run
        events.append(run)
        events += self._pump(final=self.done)
        if self.behind:  # a read takes a bounded block (LineCursor.max_bytes): not done until all is read
            self.done = False
        if not self.done and time.monotonic() - self._last_reconcile > RECONCILE_EVERY_S:
            reconcile(self.store)
            self._last_reconcile = time.monotonic()
        return events

    def join(self, *, tail: int | None, since: float | None, offset: int | None = None,
             rounds: int = JOIN_ROUNDS) -> tuple[list[Lines], list[Lines]]:
        """A newcomer's first lines, read up to exactly where this follow is, so that from then on it needs
        only what `step` reads: (lines this follow read meanwhile, for those already following; the
        newcomer's lines). The newcomer starts at byte `offset` (a page resuming), or at `since`, or its last
        `tail` lines, or the attempt's first line. Call between steps (never during one)."""
        ours: list[Lines] = []
        theirs: list[Lines] = []
        for source, cursor in self.cursors or []:
            mine = LineCursor(cursor.path)
            lines = []
            if offset is not None:
                mine.offset = max(0, offset)
            elif since is not None:
                mine.start_at_time(since)
            elif tail is not None:
                lines = mine.start_at_tail(tail)
            lines += _read_on(mine, self.done)
            # Both read to the end of the file: whichever is behind reads on until both stopped at the same
            # byte (they differ only when the log grew between two reads, a few microseconds).
            for _ in range(rounds):
                if mine.offset == cursor.offset:
                    break
                if mine.offset < cursor.offset:
                    lines += _read_on(mine, self.done)
                else:
                    caught = _read_on(cursor, self.done)
                    if caught:
                        ours.append(_masked(source, caught, self.mask, self.current, cursor))
            if lines:
                theirs.append(_masked(source, lines, self.mask, self.current, mine))
        return ours, theirs


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
    following = Following(run_id, store=store, node=node, rank=rank, attempt=attempt, tail=tail, mask=mask,
                          since=since)
    while True:
        yield from following.step()
        if following.done:
            return
        if not following.behind:
            time.sleep(POLL_S)

