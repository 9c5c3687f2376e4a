"""A rank's entry point: `python -m air.distributed.worker CALL_DIR`.

Loads the caller's function and arguments, runs them once, and writes this rank's outcome. Kept free
of heavy imports: the only cost a rank should pay is the user's own (torch).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import traceback
from pathlib import Path

import cloudpickle

from air.distributed.outcome import error, ok, write_outcome

_PR_SET_PDEATHSIG = 1


def _die_with_launcher() -> None:
    """If the launching process dies (even by SIGKILL), this rank gets SIGTERM instead of lingering."""
    launcher = int(os.environ.get("AIR_LAUNCHER_PID", "0") or 0)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if launcher and os.getppid() != launcher:  # it died before prctl took effect
        os._exit(128 + signal.SIGTERM)


def _user_traceback(exc: BaseException) -> str:
    """The traceback from the user's function down, without this module's frames."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def main(call_dir: Path) -> int:
    _die_with_launcher()
    rank = int(os.environ.get("RANK", "0"))
    for entry in reversed(json.loads(os.environ.get("AIR_SYS_PATH", "[]"))):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    from air.distributed.mlflow_gate import install

    install(os.environ.get("AIR_MLFLOW_ENV_FILE"))
    try:
        with open(call_dir / "payload.pkl", "rb") as fh:
            func, args, kwargs = cloudpickle.load(fh)
    except Exception as exc:
        write_outcome(call_dir, error(rank, exc, _user_traceback(exc)))
        return 1
    try:
        value = func(*args, **kwargs)
    except SystemExit as exc:
        if exc.code in (None, 0):
            value = None
        else:
            write_outcome(call_dir, error(rank, exc, _user_traceback(exc)))
            return 1
    except BaseException as exc:  # noqa: BLE001 - every failure is this rank's outcome
        write_outcome(call_dir, error(rank, exc, _user_traceback(exc)))
        sys.stderr.write(_user_traceback(exc))
        return 1
    outcome = ok(rank, value)
    write_outcome(call_dir, outcome)
    return 0 if outcome.ok else 1


if __name__ == "__main__":
    code = main(Path(sys.argv[1]))
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)
