"""Runs: the run store (SQLite, WAL), run and attempt states, run folders, termination reasons, log tails.

Internal to air (the CLI, the supervisor and the backends use it); users meet it through `air` commands.
"""

from air.runs.logtail import follow, tail_lines
from air.runs.paths import (
    RunPaths,
    atomic_write_bytes,
    atomic_write_text,
    is_run_id,
    new_run_id,
    parse_run_id,
    parse_run_id_fragment,
)
from air.runs.reasons import TerminationReason, scan_line, termination_reason
from air.runs.states import (
    AttemptStatus,
    FailureClass,
    IllegalTransitionError,
    RetryDecision,
    RetryPolicy,
    RetryVerdict,
    RunStatus,
    StatusConflictError,
    can_transition,
    check_transition,
)
from air.runs.store import Attempt, CreateRunResult, Run, RunStore, supervisor_alive

__all__ = [
    "Attempt",
    "AttemptStatus",
    "CreateRunResult",
    "FailureClass",
    "IllegalTransitionError",
    "RetryDecision",
    "RetryPolicy",
    "RetryVerdict",
    "Run",
    "RunPaths",
    "RunStatus",
    "RunStore",
    "StatusConflictError",
    "TerminationReason",
    "atomic_write_bytes",
    "atomic_write_text",
    "can_transition",
    "check_transition",
    "follow",
    "is_run_id",
    "new_run_id",
    "parse_run_id",
    "parse_run_id_fragment",
    "scan_line",
    "supervisor_alive",
    "tail_lines",
    "termination_reason",
]
