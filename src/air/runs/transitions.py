"""What the run controller publishes: a typed `Transition` for each state change it makes, to the
`RunListener`s its builder passes (air/runs/listeners/: MLflow tracking, run credentials, progress
files, status lines), as Ray Train V2 hands its controller callbacks. The controller names none of them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from air.backends.base import Allocation, AttemptHandle
from air.store.states import AttemptStatus, RunStatus


class Phase(str, Enum):
    ACQUIRE = "ACQUIRE"
    START = "START"
    WAIT = "WAIT"
    FINISH = "FINISH"
    DONE = "DONE"


class Change(str, Enum):
    STEP = "step"  # one `step()`: `before` -> `after` are phases (START -> WAIT: the nodes started)
    RUN = "run"  # the run's status `after` was written
    ATTEMPT_STARTED = "attempt started"  # its row and logs exist, its nodes are not launched yet
    PROGRESS = "progress"  # how long each node process was quiet (`processes`), which nodes `ended`
    ATTEMPT_ENDING = "attempt ending"  # judged, not yet recorded; `retry`: a retry is due
    ATTEMPT_ENDED = "attempt ended"  # recorded as `after` (None: air failed, its caller records it)
    RUN_ENDED = "run ended"  # the controller is done with the run, however it ended


@dataclass(frozen=True)
class Transition:
    """One state change of a run's controller, with what listeners need to act on it."""

    kind: Change
    run_id: str
    before: Phase | None = None
    after: Phase | RunStatus | AttemptStatus | None = None
    status: RunStatus | None = None  # the run's end state, once it has one
    attempt: int | None = None
    reason: str | None = None
    canceled: bool = False  # the attempt was ended by a cancel or a preemption
    retry: bool = False  # ATTEMPT_ENDED: the run goes on with another attempt
    node_logs: Mapping[int, Path] = field(default_factory=dict)
    log: Callable[[str], None] | None = None  # ATTEMPT_STARTED: where air's lines about the attempt go
    handle: AttemptHandle | None = None
    allocation: Allocation | None = None
    processes: tuple[Mapping[str, object], ...] = ()
    ended: tuple[Mapping[str, object], ...] = ()


class RunListener:
    """Acts on a controller's transitions, in the order of its list; never fails a run (it catches what
    its own effect may raise)."""

    def on_transition(self, t: Transition) -> None:
        """Called once the change is made (ATTEMPT_ENDING: just before it is recorded)."""

    def node_env(self, t: Transition, env: dict[str, str]) -> dict[str, str]:
        """ATTEMPT_STARTED: the nodes' environment, as the listeners before this one made it."""
        return env
