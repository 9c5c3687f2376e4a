"""Per-rank outcomes are plain data until the caller raises.

A rank writes `ok(value)` or `error(exception, traceback text)` to its outcome file: a bounded, typed
JSON header (ended ok or not, the exception's type name, message and traceback text) beside the
pickled value or exception as opaque bytes. Whoever drives the call (the caller itself, or an `air
server`'s call driver, as root) reads only the header: `settle` turns the outcomes (with the processes'
exits) into a `CallResult` without unpickling anything, and only the caller, which trusts its own
function, unpickles it (`CallResult.load`): every rank's value, or the failing rank's own exception.
Through a server the result travels as the same kind of header and bytes (`CallResult.to_bytes`).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cloudpickle

from air.constants import ECHO_WINDOW_S
from air.errors import AirError, LocalExecutionTimeoutError, RankFailedError, SerializationError
from air.files import atomic_write_bytes
from air.launcher.node import ProcessExit, read_tail

#: First line of a rank's outcome file, and of a call's result a server sends its caller.
OUTCOME_MAGIC = b"AIR-OUTCOME 1\n"
RESULT_MAGIC = b"AIR-CALL-RESULT 1\n"
#: Bounds of the typed header a server reads: the whole header, and each text in it (characters).
HEADER_MAX_BYTES = 1 << 20
TYPE_MAX_CHARS = 1000
MESSAGE_MAX_CHARS = 20_000
TRACEBACK_MAX_CHARS = 100_000
#: A path a result names (a rank's log) and the most ranks a result lists.
PATH_MAX_CHARS = 4096
MAX_RANKS = 100_000


@dataclass(frozen=True)
class RankOutcome:
    """What one rank reported. `payload` is the pickled value or exception: opaque bytes, which only the
    caller unpickles (`CallResult.load`)."""

    rank: int
    ok: bool
    payload: bytes | None
    exc_type: str | None = None
    exc_message: str | None = None
    traceback: str | None = None
    raised_at: float = 0.0


def outcome_path(call_dir: Path, rank: int) -> Path:
    """Where a rank answers (beside the payload it ran, air.store.paths.CALL_PAYLOAD_FILE)."""
    return call_dir / f"rank_{rank}.outcome"


def done_path(call_dir: Path, rank: int) -> Path:
    """Written by a rank once its successful result is reported: whatever happens to it afterwards (a
    release that hangs, a crash on the way out) fails nothing."""
    return call_dir / f"rank_{rank}.done"


def hang_path(call_dir: Path, rank: int) -> Path:
    """Where a rank's stacks go when releasing what its function left behind hangs (worker.release_guarded);
    empty (then removed) while it does not."""
    return call_dir / f"rank_{rank}.hang"


def _head(text: str | None, limit: int) -> str | None:
    return text if text is None or len(text) <= limit else text[:limit - 20] + " …(cut by air)"


def _tail(text: str | None, limit: int) -> str | None:
    """A traceback's end says the most (the raise): its start is what goes."""
    return text if text is None or len(text) <= limit else "(cut by air) … " + text[-(limit - 20):]


def _framed(magic: bytes, header: dict[str, Any], payloads: Iterable[bytes]) -> list[bytes]:
    data = json.dumps(header, ensure_ascii=False).encode()
    if len(data) > HEADER_MAX_BYTES:  # only where the texts were already cut: the payloads decide
        raise ValueError(f"outcome header of {len(data)} bytes")
    return [magic, data, b"\n", *payloads]


def _split(data: bytes, magic: bytes) -> tuple[dict[str, Any], bytes]:
    """(header, the bytes after it); ValueError for anything not framed as air frames it."""
    if not data.startswith(magic):
        raise ValueError("not an air frame")
    end = data.find(b"\n", len(magic), len(magic) + HEADER_MAX_BYTES + 1)
    if end < 0:
        raise ValueError("no header within its bound")
    try:
        header = json.loads(data[len(magic):end])
    except RecursionError:  # nested past the C parser's guard (a rank can write anything): not air's frame
        raise ValueError("the header nests too deep") from None
    if not isinstance(header, dict):
        raise ValueError("the header is not an object")
    return header, data[end + 1:]


def _str(header: dict[str, Any], key: str, limit: int) -> str | None:
    value = header.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > limit:
        raise ValueError(f"{key}: not a string of at most {limit} characters")
    return value


def _int(value: object, what: str, *, low: int = 0, high: int = 1 << 62) -> int:
    if type(value) is not int or not low <= value <= high:
        raise ValueError(f"{what}: not an integer in [{low}, {high}]")
    return value


def write_outcome(call_dir: Path, outcome: RankOutcome) -> None:
    """Atomic: a half-written outcome is never read. The texts are cut to the bounds a reader holds them to."""
    header = {"rank": outcome.rank, "ok": outcome.ok,
              "payload_bytes": None if outcome.payload is None else len(outcome.payload),
              "exc_type": _head(outcome.exc_type, TYPE_MAX_CHARS),
              "exc_message": _head(outcome.exc_message, MESSAGE_MAX_CHARS),
              "traceback": _tail(outcome.traceback, TRACEBACK_MAX_CHARS), "raised_at": outcome.raised_at}
    payloads = [] if outcome.payload is None else [outcome.payload]
    atomic_write_bytes(outcome_path(call_dir, outcome.rank), _framed(OUTCOME_MAGIC, header, payloads), durable=False)


def parse_outcome(data: bytes, rank: int, max_payload_bytes: int | None = None) -> RankOutcome | None:
    """A rank's outcome file, read as typed data (its payload stays bytes); None for anything malformed,
    which counts as no outcome (the rank's exit is reported). A payload over `max_payload_bytes` (an air
    server's bound on a call's result) becomes this rank's error, named as such."""
    try:
        header, rest = _split(data, OUTCOME_MAGIC)
        if _int(header.get("rank"), "rank") != rank or not isinstance(header.get("ok"), bool):
            return None
        size = header.get("payload_bytes")
        if (size is None and rest) or (size is not None and _int(size, "payload_bytes") != len(rest)):
            return None
        raised_at = header.get("raised_at", 0.0)
        if not isinstance(raised_at, int | float) or isinstance(raised_at, bool) or not math.isfinite(raised_at):
            return None
        outcome = RankOutcome(rank=rank, ok=header["ok"], payload=rest if size is not None else None,
                              exc_type=_str(header, "exc_type", TYPE_MAX_CHARS),
                              exc_message=_str(header, "exc_message", MESSAGE_MAX_CHARS),
                              traceback=_str(header, "traceback", TRACEBACK_MAX_CHARS), raised_at=float(raised_at))
    except (ValueError, UnicodeDecodeError):
        return None
    if outcome.ok and outcome.payload is None:
        return None
    if max_payload_bytes is not None and outcome.payload is not None and len(outcome.payload) > max_payload_bytes:
        what = "return value" if outcome.ok else f"exception ({outcome.exc_type})"
        err = SerializationError(
            f"The {what} of rank {rank} is {len(outcome.payload):,} bytes pickled, more than the "
            f"{max_payload_bytes:,} a call through an air server may return per rank.",
            hint="Save large objects to a file (e.g. under AIR_CHECKPOINT_DIR) and return its path.")
        return RankOutcome(rank=rank, ok=False, payload=None, exc_type=_qualified(err), exc_message=str(err),
                           traceback=outcome.traceback, raised_at=outcome.raised_at or time.time())
    return outcome


def read_outcome(call_dir: Path, rank: int, max_payload_bytes: int | None = None) -> RankOutcome | None:
    try:
        data = outcome_path(call_dir, rank).read_bytes()
    except OSError:  # missing (or unreadable) is as good as none: the exit code will be reported
        return None
    return parse_outcome(data, rank, max_payload_bytes)


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


def _qualified(exc: BaseException) -> str:
    return f"{type(exc).__module__}.{type(exc).__qualname__}"


def error(rank: int, exc: BaseException, traceback_text: str) -> RankOutcome:
    """The exception pickled as it is; whether it can be rebuilt is the caller's to find out (only the
    caller unpickles it; one that cannot be rebuilt there comes back as text, RankFailedError)."""
    try:
        payload: bytes | None = cloudpickle.dumps(exc)
    except Exception:
        payload = None
    return RankOutcome(rank=rank, ok=False, payload=payload, exc_type=_qualified(exc),
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


@dataclass(frozen=True)
class RankRaised:
    """A rank's own exception, still pickled: what the call failed with, and where (typed data only)."""

    outcome: RankOutcome
    world_size: int
    #: Every rank that raised the same (type and message): "raised on ranks 0, 1 of 2".
    same: tuple[int, ...]
    log_path: str

    def reason(self) -> str:
        """The run's termination reason, read from the header alone."""
        name = (self.outcome.exc_type or "Exception").rsplit(".", 1)[-1]
        first = (self.outcome.exc_message or "").splitlines()[0] if self.outcome.exc_message else ""
        rank = self.outcome.rank
        who = "" if first.lower().startswith(f"rank {rank}") else f"Rank {rank}: "
        return f"{who}{name}: {first}"[:500]

    def rebuild(self) -> BaseException:
        """The exception itself, unpickled: only in the caller, which trusts its own function."""
        outcome = self.outcome
        exc: BaseException | None = None
        if outcome.payload is not None:
            try:
                exc = cloudpickle.loads(outcome.payload)
            except Exception:
                exc = None
            if not isinstance(exc, BaseException):
                exc = None
        where = (f"{_group(self.same)} of {self.world_size}" if len(self.same) > 1
                 else f"rank {outcome.rank} of {self.world_size}")
        note = f"[air] raised on {where}; log: {self.log_path}"
        if exc is None:
            exc = RankFailedError(
                f"Rank {outcome.rank} raised {outcome.exc_type}: {outcome.exc_message}\n"
                f"(the exception could not be rebuilt here; its type and traceback are shown as text)",
                rank=outcome.rank, remote_traceback=outcome.traceback, exception_type=outcome.exc_type,
                log_path=self.log_path,
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


@dataclass(frozen=True)
class CallResult:
    """What a call came to, with nothing unpickled: every rank's value (pickled, in rank order), a rank's
    own exception (`raised`), or air's own error (`error`: built from typed data, never from a pickle)."""

    values: tuple[bytes, ...] = ()
    raised: RankRaised | None = None
    error: BaseException | None = field(default=None, compare=False)

    @property
    def ok(self) -> bool:
        return self.raised is None and self.error is None

    def load(self) -> list[Any]:
        """The caller's answer: every rank's value, unpickled here, or the exception raised."""
        if self.error is not None:
            raise self.error
        if self.raised is not None:
            raise self.raised.rebuild()
        values = []
        for rank, payload in enumerate(self.values):
            try:
                values.append(cloudpickle.loads(payload))
            except Exception as exc:
                raise AirError(f"The return value of rank {rank} could not be unpickled here: {exc}") from exc
        return values

    # ---- through an air server: a typed header, then the pickled bytes, passed on untouched ----------

    def to_bytes(self) -> list[bytes]:
        """The result file a server's call driver writes and its route sends (no pickle of the server's)."""
        header: dict[str, Any] = {"values": [len(v) for v in self.values], "raised": None, "error": None}
        payloads: list[bytes] = list(self.values)
        if self.raised is not None:
            o = self.raised.outcome
            header["raised"] = {
                "rank": o.rank, "payload_bytes": None if o.payload is None else len(o.payload),
                "exc_type": _head(o.exc_type, TYPE_MAX_CHARS), "exc_message": _head(o.exc_message, MESSAGE_MAX_CHARS),
                "traceback": _tail(o.traceback, TRACEBACK_MAX_CHARS), "raised_at": o.raised_at,
                "world_size": self.raised.world_size, "same": list(self.raised.same),
                "log_path": _head(self.raised.log_path, PATH_MAX_CHARS)}
            payloads = [] if o.payload is None else [o.payload]
        if self.error is not None:
            header["error"] = _error_state(self.error)
            payloads = []
        return _framed(RESULT_MAGIC, header, payloads)

    @classmethod
    def from_bytes(cls, data: bytes) -> CallResult:
        """The caller's side of `to_bytes`: the header checked, the bytes kept for `load`."""
        try:
            header, rest = _split(data, RESULT_MAGIC)
            if header.get("error") is not None:
                return cls(error=_error_from_state(header["error"]))
            raised = header.get("raised")
            if raised is not None:
                if not isinstance(raised, dict):
                    raise ValueError("raised: not an object")
                size = raised.get("payload_bytes")
                if (size is None and rest) or (size is not None and _int(size, "payload_bytes") != len(rest)):
                    raise ValueError("raised: payload_bytes does not match")
                world = _int(raised.get("world_size"), "world_size", low=1, high=MAX_RANKS)
                same = raised.get("same")
                if not isinstance(same, list) or len(same) > MAX_RANKS:
                    raise ValueError("same: not a list of ranks")
                outcome = RankOutcome(rank=_int(raised.get("rank"), "rank", high=MAX_RANKS), ok=False,
                                      payload=rest if size is not None else None,
                                      exc_type=_str(raised, "exc_type", TYPE_MAX_CHARS),
                                      exc_message=_str(raised, "exc_message", MESSAGE_MAX_CHARS),
                                      traceback=_str(raised, "traceback", TRACEBACK_MAX_CHARS))
                return cls(raised=RankRaised(outcome, world, tuple(_int(r, "same", high=MAX_RANKS) for r in same),
                                             _str(raised, "log_path", PATH_MAX_CHARS) or ""))
            sizes = header.get("values")
            if not isinstance(sizes, list) or len(sizes) > MAX_RANKS:
                raise ValueError("values: not a list of sizes")
            values, at = [], 0
            for size in sizes:
                n = _int(size, "values")
                values.append(rest[at:at + n])
                at += n
            if at != len(rest):
                raise ValueError("values: the sizes do not add up")
            return cls(values=tuple(values))
        except (ValueError, UnicodeDecodeError, TypeError) as exc:
            raise AirError(f"The server's answer for this call is malformed ({exc}).",
                           hint="Check that this client's air version matches the server's (`air version`).") from None


#: What of an air error crosses to the caller: its class (by name, in air.errors) and plain attributes.
_PLAIN = (str, int, float, bool, type(None))


def _error_state(exc: BaseException) -> dict[str, Any]:
    """Air's own error as typed data; anything else (a server-side surprise) as a WorkloadFailureException."""
    from air import errors

    if not isinstance(exc, AirError):
        exc = errors.WorkloadFailureException(f"The call failed on the server: {type(exc).__name__}: {exc}"[:2000])
    # The class the caller rebuilds: the nearest one air.errors defines (a subclass elsewhere keeps its kind).
    name = next(c.__name__ for c in type(exc).__mro__ if getattr(errors, c.__name__, None) is c)
    state: dict[str, Any] = {}
    for key, value in vars(exc).items():
        if isinstance(value, _PLAIN):
            state[key] = _head(value, MESSAGE_MAX_CHARS) if isinstance(value, str) else value
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):  # __notes__
            state[key] = [_head(v, MESSAGE_MAX_CHARS) for v in value[:20]]
    return {"class": name, "message": _head(exc.message, MESSAGE_MAX_CHARS), "hint": exc.hint,
            "state": state}


def _error_from_state(state: object) -> BaseException:
    """Rebuild an air error by name: only a class of air.errors, with only plain attributes."""
    from air import errors

    if not isinstance(state, dict):
        raise ValueError("error: not an object")
    cls = getattr(errors, str(state.get("class")), None)
    if not (isinstance(cls, type) and issubclass(cls, AirError)):
        cls = errors.WorkloadFailureException
    message, hint, attrs = state.get("message"), state.get("hint"), state.get("state")
    if not isinstance(message, str) or not (hint is None or isinstance(hint, str)) or not isinstance(attrs, dict):
        raise ValueError("error: malformed")
    plain: dict[str, object] = {str(k): v for k, v in attrs.items()
             if isinstance(v, _PLAIN) or (isinstance(v, list) and all(isinstance(x, str) for x in v))}
    err = cls.__new__(cls)  # as AirError.__reduce__ rebuilds one: no __init__ to guess the arguments of
    Exception.__init__(err, message)
    err.__dict__.update(plain)
    err.message, err.hint = message, hint
    return err


def settle(
    outcomes: Sequence[RankOutcome | None],
    exits: Sequence[ProcessExit],
    log_paths: Sequence[Path],
    *,
    timed_out: bool,
    timeout_s: float | None,
    interrupted: bool = False,
) -> CallResult:
    """Every rank's value (still pickled, in rank order) or the root-cause rank exception (still pickled),
    judged from the outcomes' headers and the processes' exits alone; air's own errors (a rank that died,
    the timeout, a missing outcome) are raised. Nothing is unpickled here: a server may run this.
    `exits`: the rank processes' exits as the backend returns them (each names its global `rank`)."""
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
        same = tuple(sorted(o.rank for o in errors
                            if o.exc_type == first_error.exc_type and o.exc_message == first_error.exc_message))
        return CallResult(raised=RankRaised(first_error, world_size, same, str(log_paths[first_error.rank])))
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
    values: list[bytes] = []
    for outcome in outcomes:
        assert outcome is not None and outcome.payload is not None
        values.append(outcome.payload)
    return CallResult(values=tuple(values))



def resolve(
    outcomes: Sequence[RankOutcome | None],
    exits: Sequence[ProcessExit],
    log_paths: Sequence[Path],
    *,
    timed_out: bool,
    timeout_s: float | None,
    interrupted: bool = False,
) -> list[Any]:
    """`settle`, then `CallResult.load`: the caller's result, unpickled. Only for the caller's own process."""
    return settle(outcomes, exits, log_paths, timed_out=timed_out, timeout_s=timeout_s,
                  interrupted=interrupted).load()
