"""Per-rank outcomes are plain data until one place raises.

A rank writes `ok(value)` or `error(exception, traceback text)` to its outcome file; the caller reads
them all and exactly one function, `resolve`, turns them (with the processes' exits) into the list of
results or the one exception the caller sees.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cloudpickle

from air.constants import ECHO_WINDOW_S
from air.errors import AirError, LocalExecutionTimeoutError, RankFailedError, SerializationError
from air.files import atomic_write_bytes
from air.launcher.node import ProcessExit, read_tail


@dataclass(frozen=True)
class RankOutcome:
    """What one rank reported. `payload` is the pickled value or exception (loaded lazily)."""

    rank: int
    ok: bool
    payload: bytes | None
    exc_type: str | None = None
    exc_message: str | None = None
    traceback: str | None = None
    raised_at: float = 0.0


def outcome_path(call_dir: Path, rank: int) -> Path:
    """Where a rank answers (beside the payload it ran, air.runs.paths.CALL_PAYLOAD_FILE)."""
    return call_dir / f"rank_{rank}.outcome"


def done_path(call_dir: Path, rank: int) -> Path:
    """Written by a rank once its successful result is reported: whatever happens to it afterwards (a
    release that hangs, a crash on the way out) fails nothing."""
    return call_dir / f"rank_{rank}.done"


def hang_path(call_dir: Path, rank: int) -> Path:
    """Where a rank's stacks go when releasing what its function left behind hangs (worker.release_guarded);
    empty (then removed) while it does not."""
    return call_dir / f"rank_{rank}.hang"


def write_outcome(call_dir: Path, outcome: RankOutcome) -> None:
    """Atomic: a half-written outcome is never read."""
    data = pickle.dumps(outcome, protocol=pickle.HIGHEST_PROTOCOL)
    atomic_write_bytes(outcome_path(call_dir, outcome.rank), data, durable=False)


def read_outcome(call_dir: Path, rank: int) -> RankOutcome | None:
    try:
        with open(outcome_path(call_dir, rank), "rb") as fh:
            return pickle.load(fh)
    except FileNotFoundError:
        return None
    except Exception:  # a corrupt file is as good as none: the exit code will be reported
        return None


def ok(rank: int, value: object) -> RankOutcome:
    """Pickle the return value now, so an unpicklable one becomes this rank's error, named as such."""
    try:
        payload = cloudpickle.dumps(value)
    except Exception as exc:
        err = SerializationError(
            f"The return value of rank {rank} ({type(value).__name__}) could not be pickled: {exc}",
            hint="Return plain data (numbers, lists, dicts, tensors moved to CPU, state_dict()s), "
            "or save large objects to a file and return its path.",
        )
        return error(rank, err, "")
    return RankOutcome(rank=rank, ok=True, payload=payload)


def error(rank: int, exc: BaseException, traceback_text: str) -> RankOutcome:
    try:
        payload: bytes | None = cloudpickle.dumps(exc)
        cloudpickle.loads(payload)  # some exceptions pickle but cannot be rebuilt
    except Exception:
        payload = None
    return RankOutcome(rank=rank, ok=False, payload=payload, exc_type=f"{type(exc).__module__}.{type(exc).__qualname__}",
                       exc_message=str(exc), traceback=traceback_text, raised_at=time.time())


class RemoteTraceback(Exception):
    """Carries a rank's traceback text as the `__cause__` of the re-raised exception."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return "\n" + self.text


def _group(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def _rebuild_exception(outcome: RankOutcome, world_size: int, log_path: Path, same: Sequence[int]) -> BaseException:
    exc: BaseException | None = None
    if outcome.payload is not None:
        try:
            exc = cloudpickle.loads(outcome.payload)
        except Exception:
            exc = None
    where = f"{_group(same)} of {world_size}" if len(same) > 1 else f"rank {outcome.rank} of {world_size}"
    note = f"[air] raised on {where}; log: {log_path}"
    if exc is None:
        exc = RankFailedError(
            f"Rank {outcome.rank} raised {outcome.exc_type}: {outcome.exc_message}\n"
            f"(the exception could not be rebuilt here; its type and traceback are shown as text)",
            rank=outcome.rank, remote_traceback=outcome.traceback, exception_type=outcome.exc_type,
            log_path=str(log_path),
        )
    if outcome.traceback:
        exc.__cause__ = RemoteTraceback(outcome.traceback)
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    try:
        exc.air_rank = outcome.rank  # type: ignore[attr-defined]
        exc.air_remote_traceback = outcome.traceback  # type: ignore[attr-defined]
    except Exception:
        pass
    return exc


def resolve(
    outcomes: Sequence[RankOutcome | None],
    exits: Sequence[ProcessExit],
    log_paths: Sequence[Path],
    *,
    timed_out: bool,
    timeout_s: float | None,
    interrupted: bool = False,
) -> list[Any]:
    """The caller's result: every rank's value in rank order, or the root-cause exception. `exits`: the
    rank processes' exits as the backend returns them (each names its global `rank`)."""
    world_size = len(outcomes)
    errors = [o for o in outcomes if o is not None and not o.ok]
    # A rank that died without reporting (exit, signal) is a root-cause candidate too, unless air killed
    # it during teardown. The earliest event wins: peers of a dead rank fail a moment *after* it.
    deaths = [e for e in exits if e.rank is not None and e.returncode not in (None, 0)
              and outcomes[e.rank] is None and not e.killed_by_launcher]
    first_error = min(errors, key=lambda o: o.raised_at) if errors else None
    first_death = min(deaths, key=lambda e: e.ended_at or float("inf")) if deaths else None
    if first_error is not None and (
            first_death is None or (first_death.ended_at or 0.0) > first_error.raised_at + ECHO_WINDOW_S):
        same = sorted(o.rank for o in errors
                      if o.exc_type == first_error.exc_type and o.exc_message == first_error.exc_message)
        raise _rebuild_exception(first_error, world_size, log_paths[first_error.rank], same)
    if first_death is not None and first_death.rank is not None:
        rank = first_death.rank
        tail = read_tail(log_paths[rank], 30)
        echoes = sorted(o.rank for o in errors)
        raise RankFailedError(
            f"Rank {rank} of {world_size} died without a Python exception ({first_death.describe()})."
            + (f"\nLast lines of its log ({log_paths[rank]}):\n{tail}" if tail else f"\nIts log: {log_paths[rank]} (empty)")
            + (f"\n({_group(echoes)} then failed too, as a consequence.)" if echoes else ""),
            rank=rank, exit_code=first_death.returncode if (first_death.returncode or 0) > 0 else None,
            signal_name=first_death.signal_name, log_path=str(log_paths[rank]), log_tail=tail,
            hint="All other ranks were ended. SIGKILL often means the machine ran out of memory; SIGSEGV a crash "
            "in native code.",
        )
    if timed_out:
        raise LocalExecutionTimeoutError(
            f"The call ran past its timeout of {timeout_s:g} s; all {world_size} ranks were ended.",
            hint=f"Rank logs: {log_paths[0].parent}. Pass a larger timeout= (or timeout=None) to "
            "@distributed or with_overrides().",
        )
    missing = [r for r, o in enumerate(outcomes) if o is None]
    if missing or interrupted:
        raise RankFailedError(
            f"{_group(missing).capitalize()} ended without reporting a result.",
            rank=missing[0] if missing else None, log_path=str(log_paths[missing[0]]) if missing else None,
        )
    values = []
    for outcome in outcomes:
        assert outcome is not None and outcome.payload is not None
        try:
            values.append(cloudpickle.loads(outcome.payload))
        except Exception as exc:
            raise AirError(f"The return value of rank {outcome.rank} could not be unpickled here: {exc}") from exc
    return values
