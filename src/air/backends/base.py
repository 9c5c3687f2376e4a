"""What a Backend does for a run: hold capacity, start an attempt's nodes, end them.

The supervisor (air/supervisor.py) drives a run through these calls and knows nothing of where
nodes run. `local` runs nodes as process trees on this machine with a slot ledger; `ray` runs each
node through an agent actor on a distinct Ray node, inside one gang-scheduled placement group.
Both start node processes with the same node launcher (air/launcher).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from air.accelerators import AcceleratorType

#: on_line(node_rank, stream, text): every line a node prints, as it arrives (also written to its log).
NodeLineCallback = Callable[[int, str, str], None]


@dataclass(frozen=True)
class NodeTask:
    """One node's share of an attempt, before the backend places it.

    `env` holds the run's contract variables except those only placement decides: the backend adds
    MASTER_ADDR, MASTER_PORT and the node's device slice (CUDA_VISIBLE_DEVICES), and AIR_PROCESS_TAG.
    `log_path` is on the submitting machine: a remote backend streams lines back into it.
    """

    node_rank: int
    argv: Sequence[str]
    env: dict[str, str]
    log_path: Path
    cwd: Path | None = None


@dataclass(frozen=True)
class Allocation:
    """Capacity held for one run: which node gets which device slots (indices or GPU ids)."""

    run_id: str
    accelerator: AcceleratorType
    num_nodes: int
    slots_per_node: tuple[tuple[str, ...], ...]
    details: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class NodeExit:
    """How one node's command ended."""

    node_rank: int
    returncode: int | None
    signal_name: str | None
    killed_by_air: bool = False
    address: str = "127.0.0.1"


@dataclass(frozen=True)
class AttemptOutcome:
    """What an attempt's nodes did, as plain data; the supervisor turns it into state and a reason."""

    exits: tuple[NodeExit, ...]
    first_failure: NodeExit | None
    timed_out: bool = False
    stopped: bool = False
    lost_node: str | None = None  # "node <address> lost" when a machine went away mid-attempt

    @property
    def ok(self) -> bool:
        return self.first_failure is None and not self.timed_out and not self.stopped and self.lost_node is None


class AttemptHandle(Protocol):
    """A started attempt."""

    def wait(self, *, timeout_s: float | None, should_stop: Callable[[], bool]) -> AttemptOutcome:
        """Block until every node ends, one fails, the timeout passes or should_stop(); in every case but
        success, every node's process tree is ended before this returns."""
        ...

    def terminate(self) -> None:
        """End every node's process tree now (idempotent)."""
        ...


class Backend(Protocol):
    """Where a run's nodes run."""

    name: str

    def check_shape(self, accelerator: AcceleratorType, num_nodes: int) -> None:
        """Refuse at submit (GPUValidationError, exit 2) a shape this backend can never hold; say what it has."""
        ...

    def describe_capacity(self) -> str:
        """One line for errors and `--dry-run`: what this backend has."""
        ...

    def acquire(self, run_id: str, accelerator: AcceleratorType, num_nodes: int, *,
                should_stop: Callable[[], bool], on_wait: Callable[[str], None]) -> Allocation | None:
        """Block (the run is QUEUED) until capacity is held, first in first out; None if should_stop().
        `on_wait` receives a line such as "waiting for capacity: 2 of 2 CPU slots busy" now and then."""
        ...

    def start_attempt(self, allocation: Allocation, nodes: Sequence[NodeTask], *, tag: str,
                      on_line: NodeLineCallback | None = None) -> AttemptHandle:
        """Start every node's command at once (gang), each in its own process tree tagged `tag`."""
        ...

    def release(self, allocation: Allocation) -> None:
        """Give the capacity back (idempotent)."""
        ...

    def reap(self, tag: str) -> int:
        """End any process still carrying `tag` (a dead supervisor's leftovers); returns how many."""
        ...
