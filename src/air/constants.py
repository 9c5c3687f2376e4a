"""Tunables in one place (grace periods, timeouts, defaults). Tests pass smaller values in.

The ones a user may change through the environment read their `AIR_*` variable here (registered, with
its default, in air/settings.py). Poll intervals private to one loop stay beside that loop.
"""

from __future__ import annotations

import os

from air.settings import AIR_RAY_JOIN_TIMEOUT_S, AIR_RELEASE_TIMEOUT_S, AIR_TERMINATE_GRACE_S


def float_env(name: str, default: float) -> float:
    """A tunable read from the environment (tests set small values), else its default."""
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


#: Seconds between SIGTERM and SIGKILL when a process tree is ended. Short on purpose: a rank stuck in a
#: collective does not need 30 s to notice it should die, and the others must not hang (SPEC pain 1).
TERMINATE_GRACE_S: float = float_env(AIR_TERMINATE_GRACE_S, 1.0)

#: How often the launcher looks at its processes.
LAUNCH_POLL_S: float = 0.02

#: After a kept zygote's leader closed its status pipe (it is exiting), how long a launch waits for it to
#: stop running before calling it ended anyway (seconds).
LEADER_EXIT_WAIT_S: float = 2.0

#: Default wall-clock cap of a local `@distributed` call (3 h, as in the reference).
DEFAULT_DISTRIBUTED_TIMEOUT_S: float = 10800.0

#: Default retries of a workload (the reference: 3 → 4 attempts).
DEFAULT_MAX_RETRIES: int = 3


#: A rank that died without reporting (signal, os._exit) within this many seconds after another rank
#: raised is taken as the root cause: its peers' errors ("Connection reset by peer") are echoes of it,
#: and the moment a death is noticed can lag the moment it happened on a busy machine.
ECHO_WINDOW_S: float = 2.0

#: How long `air cancel` waits for a run's supervisor to end it before ending its processes itself.
CANCEL_WAIT_S: float = 30.0

#: How long `air cancel` waits for a supervisor that has not started yet (no pid recorded) to appear.
CANCEL_NO_SUPERVISOR_S: float = 5.0

#: How often the admission loop looks whether the store changed (a run ended, one was queued): one cheap
#: `PRAGMA data_version` read; a pass over the queue runs only when it did (air/runs/admission.py).
ADMISSION_POLL_S: float = 0.05

#: The admission loop's pass over the queue even when nothing seemed to change (a safety tick, seconds).
ADMISSION_TICK_S: float = 2.0

#: How long `ray_launch`'s head waits for every node to join before running the driver anyway.
RAY_JOIN_TIMEOUT_S: float = float_env(AIR_RAY_JOIN_TIMEOUT_S, 120.0)

#: How often the run controller notes each node process's progress (and checks for a hang), in seconds.
PROGRESS_CHECK_S: float = 1.0

#: How often a caller or recorder of a `@distributed` call looks for an `air cancel` of it (seconds).
CANCEL_CHECK_S: float = 1.0


def release_timeout_s() -> float:
    """Seconds a rank may take to release what its function left behind, after reporting its result
    (read at each call: a test sets it after import)."""
    return float_env(AIR_RELEASE_TIMEOUT_S, 10.0)

#: The Ray backend: how long an agent's long-poll blocks when nothing happens (one call per quiet node per
#: this; lines come as batches at most every 0.5 s, events at once); how often a run waiting for its turn in
#: its pool (or its user's limit) asks again; how often `acquire` reports that it is still waiting.
POLL_WAIT_S: float = 5.0
ADMIT_POLL_S: float = 0.5
WAIT_REPORT_S: float = 10.0

#: How often a run page's live log stream (SSE) looks for new lines and for the run's end (seconds).
WEB_STREAM_POLL_S: float = 0.5

#: How often an open log stream (the API's follow, a page's SSE) checks its token again: a revoked
#: token ends the streams it opened within this many seconds (or before its next line).
STREAM_AUTH_RECHECK_S: float = 2.0

#: How often the runs and run pages refresh themselves (JavaScript) while runs are active (milliseconds).
WEB_REFRESH_MS: int = 3000

#: How long `air ui` (and the mounted pages) wait for open live streams before stopping (seconds).
WEB_SHUTDOWN_GRACE_S: float = 2.0

#: How long a web session (a login on the pages) lasts before its browser must log in again (seconds);
#: logout or revoking the token it was made from ends it sooner.
WEB_SESSION_TTL_S: float = 12 * 3600.0

# ---- air server ----------------------------------------------------------------------------------

#: Seconds a client waits for one answer of `air server` (streams wait as long as the run lasts).
SERVER_REQUEST_TIMEOUT_S: float = 60.0

#: The largest body `air server` accepts in one request (one snapshot blob, a spec): a clear 413 above it.
SERVER_MAX_UPLOAD_BYTES: int = 256 << 20

#: The most bytes the ranks' pickled return values (or a rank's exception) of a call `air server` drives may
#: have together, split evenly between the ranks: the server passes them on untouched (it never unpickles them).
SERVER_MAX_CALL_RESULT_BYTES: int = 1 << 30

#: The most files one uploaded snapshot may hold.
SERVER_MAX_SNAPSHOT_FILES: int = 100_000

#: The port `air server start` listens on unless --port says otherwise.
SERVER_DEFAULT_PORT: int = 8765
