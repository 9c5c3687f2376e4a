"""Tunables in one place (grace periods, poll intervals, defaults). Tests pass smaller values in."""

from __future__ import annotations

import os


def _float_env(name: str, default: float) -> float:
    """A tunable read from the environment (tests set small values), else its default."""
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


#: Seconds between SIGTERM and SIGKILL when a process tree is ended. Short on purpose: a rank stuck in a
#: collective does not need 30 s to notice it should die, and the others must not hang (SPEC pain 1).
TERMINATE_GRACE_S: float = _float_env("AIR_TERMINATE_GRACE_S", 1.0)

#: How often the launcher looks at its processes.
LAUNCH_POLL_S: float = 0.02

#: Default wall-clock cap of a local `@distributed` call (3 h, as in the reference).
DEFAULT_DISTRIBUTED_TIMEOUT_S: float = 10800.0

#: Lines of a rank's log quoted when it died without a Python exception.
LOG_TAIL_LINES: int = 30

#: Default retries of a workload (the reference: 3 → 4 attempts).
DEFAULT_MAX_RETRIES: int = 3

#: Environment variable that marks every process of one launch; inherited by all descendants, so a
#: teardown finds processes that left the process group or were re-parented.
PROCESS_TAG_ENV: str = "AIR_PROCESS_TAG"

#: A rank that died without reporting (signal, os._exit) within this many seconds after another rank
#: raised is taken as the root cause: its peers' errors ("Connection reset by peer") are echoes of it,
#: and the moment a death is noticed can lag the moment it happened on a busy machine.
ECHO_WINDOW_S: float = 2.0

#: How long `air cancel` waits for a run's supervisor to end it before ending its processes itself.
CANCEL_WAIT_S: float = 30.0

#: How long `air cancel` waits for a supervisor that has not started yet (no pid recorded) to appear.
CANCEL_NO_SUPERVISOR_S: float = 5.0
