"""Runs: the run store (SQLite, WAL), run and attempt states, run folders, termination reasons, log tails.

Internal to air (the CLI, the supervisor and the backends use it); users meet it through `air` commands.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

#: Name → submodule. Loaded on first use (PEP 562): a `@distributed` call imports `air.runs.paths` on its
#: path, and must not pay for the store, the reasons' regexes and the rest with it.
_WHERE = {
    "cancel_run": "cancel",
    "cancel_runs": "cancel",
    "follow": "logtail",
    "tail_lines": "logtail",
    "RunPaths": "paths",
    "atomic_write_bytes": "paths",
    "atomic_write_text": "paths",
    "is_run_id": "paths",
    "new_run_id": "paths",
    "parse_run_id": "paths",
    "parse_run_id_fragment": "paths",
    "TerminationReason": "reasons",
    "scan_line": "reasons",
    "termination_reason": "reasons",
    "AttemptStatus": "states",
    "FailureClass": "states",
    "IllegalTransitionError": "states",
    "RetryDecision": "states",
    "RetryPolicy": "states",
    "RetryVerdict": "states",
    "RunStatus": "states",
    "StatusConflictError": "states",
    "can_transition": "states",
    "check_transition": "states",
    "Attempt": "records",
    "CreateRunResult": "records",
    "Run": "records",
    "RunStore": "store",
    "supervisor_alive": "liveness",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


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
    "cancel_run",
    "cancel_runs",
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
