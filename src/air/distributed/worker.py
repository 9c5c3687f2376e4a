"""A rank's entry point: `python -m air.distributed.worker CALL_DIR`.

Loads the caller's function and arguments, runs them once, and writes this rank's outcome. Kept free
of heavy imports: the only cost a rank should pay is the user's own (torch).
"""

from __future__ import annotations

import ctypes
import faulthandler
import gc
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from types import FrameType
from typing import Any

import cloudpickle

from air.constants import release_timeout_s
from air.distributed.outcome import done_path, error, hang_path, ok, write_outcome
from air.launcher.zygote import exit_now, import_with_gc_off
from air.settings import (
    AIR_LAUNCHER_PID,
    AIR_MLFLOW_ENV_FILE,
    AIR_RANK_PRELOAD,
    AIR_STACKS_FILE,
    AIR_SYS_PATH,
)
from air.store.paths import CALL_PAYLOAD_FILE

_PR_SET_PDEATHSIG = 1


def _die_with_launcher() -> None:
    """If the launching process dies (even by SIGKILL), this rank gets SIGTERM instead of lingering."""
    launcher = int(os.environ.get(AIR_LAUNCHER_PID, "0") or 0)
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


class _FrameKeeper:
    """Holds the user's function frame past its return, so the objects it leaves behind (a DDP model,
    its process group) are released only after this rank's result is safely reported.

    Why: releasing a DDP model after `destroy_process_group()` runs torch's process-group destructor,
    which joins gloo's worker threads while holding the GIL; a worker thread that still needs the GIL to
    drop a tensor then waits forever (torch 2.x; under torchrun the same race aborts or hangs the job).
    A one-shot profile hook catches the first Python frame of the call, then switches itself off, so
    the function itself runs untraced.
    """

    def __init__(self) -> None:
        self.frames: list[FrameType] = []

    def _hook(self, frame: FrameType, event: str, _arg: object) -> None:
        if event == "call":
            self.frames.append(frame)
            sys.setprofile(None)

    def __enter__(self) -> _FrameKeeper:
        sys.setprofile(self._hook)
        return self

    def __exit__(self, *_exc: object) -> None:
        sys.setprofile(None)


def release_guarded(call_dir: Path, rank: int, leftovers: list[object]) -> None:
    """Drop what the call left behind, under a native watchdog: if the release deadlocks (see
    _FrameKeeper), the process dumps every thread's stack to rank_<N>.hang and exits after
    release_timeout_s(). Its result is already reported, so the call still succeeds (with a warning)."""
    hang_file = hang_path(call_dir, rank)
    with open(hang_file, "w") as fh:  # must stay open until the watchdog is cancelled
        faulthandler.dump_traceback_later(release_timeout_s(), exit=True, file=fh)
        try:
            if "torch.distributed" in sys.modules:
                # Let the process group's worker threads finish dropping their tensors (they need the
                # GIL for it) before the destructor that joins them runs with the GIL held.
                time.sleep(0.05)
            leftovers.clear()
        finally:
            faulthandler.cancel_dump_traceback_later()
    hang_file.unlink(missing_ok=True)


def _stacks_on_signal() -> None:
    """Dump every thread's stack on SIGUSR2 into AIR_STACKS_FILE: how a hang report gets this rank's
    stacks where py-spy is missing (air/launcher/stacks.py; the file exists once this is in place)."""
    path = os.environ.get(AIR_STACKS_FILE)
    if not path or not hasattr(signal, "SIGUSR2"):
        return
    try:
        fh = open(path, "a")  # open for the life of the rank, as faulthandler needs
        faulthandler.register(signal.SIGUSR2, file=fh, all_threads=True)
    except (OSError, RuntimeError, ValueError):
        pass


def main(call_dir: Path) -> int:
    _die_with_launcher()
    _stacks_on_signal()
    rank = int(os.environ.get("RANK", "0"))
    for entry in reversed(json.loads(os.environ.get(AIR_SYS_PATH, "[]"))):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    from air.distributed import progress_hooks
    from air.distributed.mlflow_gate import install

    progress_hooks.install()  # an MLflow metric or an optimizer step is progress (a hang check sees it)
    install(os.environ.get(AIR_MLFLOW_ENV_FILE))
    preload = [m for m in os.environ.get(AIR_RANK_PRELOAD, "").split(",") if m and m not in sys.modules]
    if preload:  # a cold start (a forked rank has them already), or one the zygote failed to import
        import_with_gc_off(preload)  # one that fails is imported again by the function, failing there
        gc.enable()
    try:
        with open(call_dir / CALL_PAYLOAD_FILE, "rb") as fh:
            func, args, kwargs = cloudpickle.load(fh)
    except Exception as exc:
        write_outcome(call_dir, error(rank, exc, _user_traceback(exc)))
        return 1
    keeper = _FrameKeeper()
    failure: list[BaseException] = []
    value: Any = None  # the user function's return value: anything it returns
    try:
        with keeper:
            value = func(*args, **kwargs)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            failure.append(exc)
    except BaseException as exc:  # every failure is this rank's outcome
        failure.append(exc)
        sys.stderr.write(_user_traceback(exc))
    if failure:
        write_outcome(call_dir, error(rank, failure[0], _user_traceback(failure[0])))
        code = 1
    else:
        outcome = ok(rank, value)
        write_outcome(call_dir, outcome)
        code = 0 if outcome.ok else 1
        if outcome.ok:
            done_path(call_dir, rank).touch()
    leftovers: list[object] = [*keeper.frames, *failure]
    del keeper, failure, func, args, kwargs, value  # the list above holds the only references now
    release_guarded(call_dir, rank, leftovers)
    return code


if __name__ == "__main__":
    exit_now(main(Path(sys.argv[1])))
