"""Run and attempt states as data: the enums, the allowed transitions, and the retry policy.

A *Run* moves through these states; every change goes through `check_transition`, so a bug or a lost
race shows up as an error instead of a run that is RUNNING forever or SUCCESS twice::

                setup done          slots free (FIFO)
      PENDING -------------> QUEUED -------------> RUNNING ------------> SUCCESS
        |                      |                    |   |
        | cancel               | cancel             |   | attempt failed, no retries left
        v                      v                    |   +--------------> FAILED | TIMEDOUT
      CANCELED              CANCELED                | attempt failed, retries left
                                                    v
                                          WAITING_FOR_RETRY --> QUEUED | PENDING | RUNNING
                                                                (the next attempt)
      RUNNING (or any state before it) -- cancel / timeout --> TERMINATING
      TERMINATING (process tree being ended) --> CANCELED | TIMEDOUT | FAILED | SUCCESS
      any state that is not terminal --> INTERNAL_ERROR   (air itself broke: the supervisor died)
      RUNNING -- preempted by a CRITICAL run --> WAITING_FOR_RETRY --> QUEUED (its old place; not a retry)

Terminal states (SUCCESS, FAILED, CANCELED, TIMEDOUT, INTERNAL_ERROR) never change again. A RUNNING run is
never CANCELED directly: cancel goes through TERMINATING, so "canceled" always means "and its processes
are gone". Each try is an *Attempt* with its own, simpler state (RUNNING → one terminal state).

Failures say whose fault they were (`FailureClass`), and `RetryPolicy` turns an attempt's failure class
into RETRY or FAIL.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum

from air.constants import DEFAULT_MAX_RETRIES
from air.errors import AirError, UserInputError


class RunStatus(str, Enum):
    """The state of a Run (what the user submitted). Values are the names shown by the CLI and stored."""

    #: Submitted; the supervisor is preparing it (code snapshot, environment) or has not started yet.
    PENDING = "PENDING"
    #: Ready to start, waiting first-in first-out for accelerator slots held by other runs.
    QUEUED = "QUEUED"
    #: An attempt's node processes are running.
    RUNNING = "RUNNING"
    #: An attempt failed and the retry policy chose to try again; the next attempt is being set up.
    WAITING_FOR_RETRY = "WAITING_FOR_RETRY"
    #: Ending: the process tree is being torn down (cancel, timeout, or a failure on another node).
    TERMINATING = "TERMINATING"
    #: Terminal. The last attempt's command exited 0 on every node.
    SUCCESS = "SUCCESS"
    #: Terminal. The last attempt failed (setup, user code or infrastructure) and no retries were left.
    FAILED = "FAILED"
    #: Terminal. The user canceled it; none of its processes are left.
    CANCELED = "CANCELED"
    #: Terminal. The last attempt ran past `timeout_minutes` and no retries were left.
    TIMEDOUT = "TIMEDOUT"
    #: Terminal. air itself failed (e.g. the supervisor died); not the user's fault.
    INTERNAL_ERROR = "INTERNAL_ERROR"

    def is_terminal(self) -> bool:
        """True once the run can never change again (and holds no slots or processes)."""
        return self in _TERMINAL_RUN

    def is_failure(self) -> bool:
        """True for the states whose termination reason is worth showing (as the reference does)."""
        return self in (RunStatus.FAILED, RunStatus.TIMEDOUT, RunStatus.INTERNAL_ERROR)

    @property
    def description(self) -> str:
        """One sentence for help texts and `air get run`."""
        return _RUN_DESCRIPTIONS[self]

    @classmethod
    def active(cls) -> frozenset[RunStatus]:
        """Every state that is not terminal: what `air list runs` shows by default."""
        return frozenset(s for s in cls if not s.is_terminal())

    @classmethod
    def terminal(cls) -> frozenset[RunStatus]:
        """The five end states."""
        return _TERMINAL_RUN

    def __str__(self) -> str:
        return self.value


_TERMINAL_RUN = frozenset(
    {RunStatus.SUCCESS, RunStatus.FAILED, RunStatus.CANCELED, RunStatus.TIMEDOUT, RunStatus.INTERNAL_ERROR}
)

_RUN_DESCRIPTIONS: dict[RunStatus, str] = {
    RunStatus.PENDING: "Submitted; preparing the code snapshot and environment.",
    RunStatus.QUEUED: "Waiting for accelerator slots, first in first out.",
    RunStatus.RUNNING: "The current attempt's node processes are running.",
    RunStatus.WAITING_FOR_RETRY: "An attempt failed; the next attempt is being set up.",
    RunStatus.TERMINATING: "Its processes are being ended.",
    RunStatus.SUCCESS: "Every node of the last attempt exited 0.",
    RunStatus.FAILED: "The last attempt failed and no retries were left.",
    RunStatus.CANCELED: "Canceled by the user; no process is left.",
    RunStatus.TIMEDOUT: "The last attempt ran past timeout_minutes and no retries were left.",
    RunStatus.INTERNAL_ERROR: "air itself failed (for example the supervisor died).",
}


class AttemptStatus(str, Enum):
    """The state of one Attempt (one try of a run, with its own logs and MLflow run)."""

    #: Its node processes are starting or running.
    RUNNING = "RUNNING"
    #: Every node exited 0.
    SUCCESS = "SUCCESS"
    #: A node failed: setup, user code or infrastructure (see the attempt's failure class).
    FAILED = "FAILED"
    #: Ran past `timeout_minutes`; its processes were ended.
    TIMEDOUT = "TIMEDOUT"
    #: The run was canceled during this attempt; its processes were ended.
    CANCELED = "CANCELED"
    #: air itself failed during this attempt (e.g. the supervisor died).
    INTERNAL_ERROR = "INTERNAL_ERROR"
    #: A CRITICAL run of its pool needed its slots: its processes were ended and the run went back to the
    #: queue, to resume from its checkpoints. Not a failure: it does not count against max_retries.
    PREEMPTED = "PREEMPTED"

    def is_terminal(self) -> bool:
        """Every state but RUNNING is final."""
        return self is not AttemptStatus.RUNNING

    def __str__(self) -> str:
        return self.value


class FailureClass(str, Enum):
    """Whose fault a failure was. Decides retries and what the user is told to fix."""

    #: Getting ready failed: dependency install, code snapshot, a command not found in the environment.
    SETUP = "SETUP"
    #: The user's command or code failed (a Python exception, a non-zero exit, CUDA out of memory).
    USER_CODE = "USER_CODE"
    #: The machine or network failed: NCCL/rendezvous errors, a node killed from outside, a lost process.
    INFRASTRUCTURE = "INFRASTRUCTURE"
    #: The attempt ran past `timeout_minutes`.
    TIMEOUT = "TIMEOUT"
    #: A node or rank made no progress (no line, heartbeat or report) for `hang_timeout_minutes`.
    HANG = "HANG"
    #: The user canceled the run.
    CANCEL = "CANCEL"

    @property
    def run_status(self) -> RunStatus:
        """The terminal run state when this failure ends the run (no retry)."""
        return {
            FailureClass.TIMEOUT: RunStatus.TIMEDOUT,
            FailureClass.CANCEL: RunStatus.CANCELED,
        }.get(self, RunStatus.FAILED)

    @property
    def attempt_status(self) -> AttemptStatus:
        """The attempt state an attempt ending with this failure gets."""
        return {
            FailureClass.TIMEOUT: AttemptStatus.TIMEDOUT,
            FailureClass.CANCEL: AttemptStatus.CANCELED,
        }.get(self, AttemptStatus.FAILED)

    def __str__(self) -> str:
        return self.value


class PriorityClass(str, Enum):
    """Where a run stands in its pool's queue (`compute.priority_class`): higher first, then first in first out.

    Stored as its `rank` (the hosted product's legacy bands: 0-99 best effort, 100-199 normal, 200-299
    critical), so the ledger orders by one integer column.
    """

    #: Runs when nothing else waits; a CRITICAL run of its pool may preempt it (it resumes later).
    BEST_EFFORT = "BEST_EFFORT"
    #: The default.
    NORMAL = "NORMAL"
    #: Goes first; when its pool is full it preempts BEST_EFFORT runs (newest first, as few as needed).
    #: Who may submit it is the server's setting (`air server start --critical-users`).
    CRITICAL = "CRITICAL"

    @property
    def rank(self) -> int:
        """The stored integer: higher is served first."""
        return _PRIORITY_RANK[self]

    @classmethod
    def from_rank(cls, rank: int | None) -> PriorityClass:
        """The class of a stored rank (None, from a row older than priorities: NORMAL)."""
        if rank is None:
            return cls.NORMAL
        return max((c for c in cls if c.rank <= rank), key=lambda c: c.rank, default=cls.BEST_EFFORT)

    def __str__(self) -> str:
        return self.value


_PRIORITY_RANK: dict[PriorityClass, int] = {
    PriorityClass.BEST_EFFORT: 0, PriorityClass.NORMAL: 100, PriorityClass.CRITICAL: 200,
}


# ---- transitions -----------------------------------------------------------------------------------

_R = RunStatus

#: Every allowed run transition, as data. Terminal states have no way out; nothing moves to PENDING
#: except a retry that has to set up again. A self-transition is not a transition (and is refused).
RUN_TRANSITIONS: Mapping[RunStatus, frozenset[RunStatus]] = {
    _R.PENDING: frozenset(
        {_R.QUEUED, _R.RUNNING, _R.WAITING_FOR_RETRY, _R.TERMINATING,
         _R.FAILED, _R.CANCELED, _R.TIMEDOUT, _R.INTERNAL_ERROR}
    ),
    _R.QUEUED: frozenset(
        {_R.RUNNING, _R.WAITING_FOR_RETRY, _R.TERMINATING,
         _R.FAILED, _R.CANCELED, _R.TIMEDOUT, _R.INTERNAL_ERROR}
    ),
    # Not CANCELED directly: processes exist, so cancel goes through TERMINATING.
    _R.RUNNING: frozenset(
        {_R.WAITING_FOR_RETRY, _R.TERMINATING, _R.SUCCESS, _R.FAILED, _R.TIMEDOUT, _R.INTERNAL_ERROR}
    ),
    _R.WAITING_FOR_RETRY: frozenset(
        {_R.PENDING, _R.QUEUED, _R.RUNNING, _R.TERMINATING,
         _R.FAILED, _R.CANCELED, _R.TIMEDOUT, _R.INTERNAL_ERROR}
    ),
    # SUCCESS too: the command may finish while a cancel is being processed; the truth wins.
    _R.TERMINATING: frozenset({_R.SUCCESS, _R.FAILED, _R.CANCELED, _R.TIMEDOUT, _R.INTERNAL_ERROR}),
    _R.SUCCESS: frozenset(),
    _R.FAILED: frozenset(),
    _R.CANCELED: frozenset(),
    _R.TIMEDOUT: frozenset(),
    _R.INTERNAL_ERROR: frozenset(),
}

#: An attempt starts RUNNING and ends once.
ATTEMPT_TRANSITIONS: Mapping[AttemptStatus, frozenset[AttemptStatus]] = {
    s: (frozenset(t for t in AttemptStatus if t.is_terminal()) if s is AttemptStatus.RUNNING else frozenset())
    for s in AttemptStatus
}


class IllegalTransitionError(AirError):
    """A state change the state machine does not allow (e.g. SUCCESS → RUNNING). Nothing was changed."""

    kind = "CONFLICT"
    code = "CONFLICT"

    def __init__(
        self,
        message: str,
        *,
        run_id: str | None = None,
        current: str | None = None,
        requested: str | None = None,
        hint: str | None = None,
    ) -> None:
        super().__init__(message, hint=hint)
        self.run_id = run_id
        self.current = current
        self.requested = requested


class StatusConflictError(IllegalTransitionError):
    """A compare-and-set lost: the run was not in the state the caller expected (someone moved it first).

    The caller should read the run again and decide from its real state (e.g. the supervisor finding
    TERMINATING because a cancel arrived). Nothing was changed.
    """


def can_transition(current: RunStatus, new: RunStatus) -> bool:
    """True if the state machine allows `current` → `new`."""
    return new in RUN_TRANSITIONS[current]


def check_transition(current: RunStatus, new: RunStatus, *, run_id: str | None = None) -> None:
    """Raise IllegalTransitionError unless `current` → `new` is allowed."""
    if can_transition(current, new):
        return
    who = f"Run {run_id}" if run_id else "A run"
    if current.is_terminal():
        message = f"{who} already ended ({current}); it cannot become {new}."
    else:
        allowed = ", ".join(sorted(s.value for s in RUN_TRANSITIONS[current]))
        message = f"{who} cannot go from {current} to {new} (allowed from {current}: {allowed})."
    raise IllegalTransitionError(message, run_id=run_id, current=current.value, requested=new.value)


def check_attempt_transition(current: AttemptStatus, new: AttemptStatus, *, what: str = "An attempt") -> None:
    """Raise IllegalTransitionError unless the attempt may go `current` → `new` (it ends only once)."""
    if new in ATTEMPT_TRANSITIONS[current]:
        return
    raise IllegalTransitionError(
        f"{what} is {current}; it cannot become {new}.", current=current.value, requested=new.value
    )


def statuses(values: Iterable[RunStatus | str]) -> frozenset[RunStatus]:
    """Parse status names given by a user (any case) into RunStatus; an unknown name is a UserInputError."""
    out: set[RunStatus] = set()
    for v in values:
        try:
            out.add(v if isinstance(v, RunStatus) else RunStatus(str(v).upper()))
        except ValueError:
            known = ", ".join(s.value for s in RunStatus)
            raise UserInputError(f"Unknown run status {v!r}.", hint=f"Known statuses: {known}.") from None
    return frozenset(out)


# ---- retry policy -----------------------------------------------------------------------------------


class RetryDecision(str, Enum):
    """What to do after a failed attempt."""

    #: Start another attempt (the run goes WAITING_FOR_RETRY).
    RETRY = "RETRY"
    #: End the run in the failure's terminal state (FAILED, TIMEDOUT or CANCELED).
    FAIL = "FAIL"


@dataclass(frozen=True)
class RetryVerdict:
    """A decision and the sentence that explains it (logged by the supervisor, shown by `--watch`)."""

    decision: RetryDecision
    message: str
    #: The run's terminal state when the decision is FAIL; None for RETRY.
    final_status: RunStatus | None = None


@dataclass(frozen=True)
class RetryPolicy:
    """Decides RETRY or FAIL for a failed attempt, with one budget: `max_retries` (attempts = retries + 1).

    User code, timeouts and infrastructure failures are retried (as the reference retries on timeout);
    a cancel never is. Setup failures (a failed dependency install, a missing command) are retried too —
    a mirror or the network may have hiccupped — but the message says a retry will likely fail the same way.
    """

    max_retries: int = DEFAULT_MAX_RETRIES
    #: Retries after a hang (FailureClass.HANG), within max_retries; None: the same as max_retries. A
    #: hang that comes back every attempt may be a deadlock in the code rather than a flaky peer.
    max_hang_retries: int | None = None

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}.")
        if self.max_hang_retries is not None and self.max_hang_retries < 0:
            raise ValueError(f"max_hang_retries must be >= 0, got {self.max_hang_retries}.")

    @property
    def max_attempts(self) -> int:
        return self.max_retries + 1

    def decide(self, attempt: int, failure_class: FailureClass) -> RetryVerdict:
        """`attempt` is the 0-based index of the attempt that just failed."""
        final = failure_class.run_status
        tried = f"attempt {attempt + 1} of {self.max_attempts}"
        if failure_class is FailureClass.CANCEL:
            return RetryVerdict(RetryDecision.FAIL, "Canceled by the user; not retried.", final)
        budget_of_class = self.max_retries
        if failure_class is FailureClass.HANG and self.max_hang_retries is not None:
            budget_of_class = min(self.max_retries, self.max_hang_retries)
        if attempt >= budget_of_class:
            budget = "retries are off (max_retries: 0)" if self.max_retries == 0 else "no retries left"
            return RetryVerdict(
                RetryDecision.FAIL, f"{_FAILED_WHAT[failure_class]} on {tried}; {budget}.", final
            )
        message = f"{_FAILED_WHAT[failure_class]} on {tried}; retrying."
        if failure_class is FailureClass.SETUP:
            message += (
                " Setup errors (such as a failed dependency install) usually fail the same way again; "
                "check the environment section of the workload."
            )
        return RetryVerdict(RetryDecision.RETRY, message)


_FAILED_WHAT: dict[FailureClass, str] = {
    FailureClass.SETUP: "Setup failed",
    FailureClass.USER_CODE: "The command failed",
    FailureClass.INFRASTRUCTURE: "An infrastructure error ended the attempt",
    FailureClass.TIMEOUT: "Timed out",
    FailureClass.HANG: "Hung (no progress)",
    FailureClass.CANCEL: "Canceled",
}

