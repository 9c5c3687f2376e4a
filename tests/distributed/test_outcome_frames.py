"""A rank's outcome and a call's result are a typed, bounded JSON header beside opaque pickled bytes
(issue 34): whoever reads the header (an air server's call driver, as root) never unpickles anything,
and whatever a rank writes in its outcome file is either a well-formed outcome or none at all."""

from __future__ import annotations

import json
import os
from pathlib import Path

import cloudpickle
import pytest

from air.distributed.outcome import (
    HEADER_MAX_BYTES,
    OUTCOME_MAGIC,
    TRACEBACK_MAX_CHARS,
    CallResult,
    RankRaised,
    error,
    ok,
    outcome_path,
    read_outcome,
    settle,
    write_outcome,
)
from air.errors import AirError, HangError, RankFailedError, UserInputError, WorkloadFailureException
from air.launcher.node import ProcessExit


class Marker:
    """Unpickling it writes a file: a header reader that unpickled would leave it behind."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, ...]:
        return (_touch, (self.path,))


def _touch(path: str) -> str:
    Path(path).write_text(str(os.getpid()))
    return "unpickled"


def _frame(header: dict[str, object], payload: bytes = b"") -> bytes:
    return OUTCOME_MAGIC + json.dumps(header).encode() + b"\n" + payload


def test_settle_reads_headers_only_and_the_caller_unpickles(tmp_path: Path) -> None:
    marker = tmp_path / "unpickled"
    write_outcome(tmp_path, ok(0, Marker(str(marker))))
    write_outcome(tmp_path, ok(1, [1, "plain"]))
    outcomes = [read_outcome(tmp_path, r) for r in (0, 1)]
    result = settle(outcomes, [], [tmp_path / "0.log", tmp_path / "1.log"], timed_out=False, timeout_s=None)
    assert not marker.exists()  # nothing was unpickled to read the outcomes, nor to settle them
    again = CallResult.from_bytes(b"".join(result.to_bytes()))  # through a server: header + bytes, as they were
    assert not marker.exists() and again.values == result.values
    assert again.load() == ["unpickled", [1, "plain"]] and marker.exists()


def test_a_ranks_exception_stays_pickled_until_the_caller_rebuilds_it(tmp_path: Path) -> None:
    try:
        raise KeyError("the real root cause")
    except KeyError as exc:
        write_outcome(tmp_path, error(1, exc, "Traceback ...\nKeyError: 'the real root cause'\n"))
    write_outcome(tmp_path, ok(0, 0))
    outcomes = [read_outcome(tmp_path, r) for r in (0, 1)]
    result = settle(outcomes, [], [tmp_path / "0.log", tmp_path / "1.log"], timed_out=False, timeout_s=None)
    assert result.raised is not None and result.raised.reason() == "Rank 1: KeyError: 'the real root cause'"
    for carried in (result, CallResult.from_bytes(b"".join(result.to_bytes()))):
        with pytest.raises(KeyError) as info:
            carried.load()
        assert info.value.args == ("the real root cause",) and info.value.air_rank == 1  # type: ignore[attr-defined]
        assert "KeyError: 'the real root cause'" in info.value.__cause__.text  # type: ignore[union-attr]
        assert any("rank 1 of 2" in note for note in getattr(info.value, "__notes__", []))


def test_an_exception_that_cannot_be_rebuilt_comes_back_as_text(tmp_path: Path) -> None:
    class NeedsTwo(Exception):
        def __init__(self, a: str, b: str) -> None:
            super().__init__(f"{a}/{b}")

    write_outcome(tmp_path, error(0, NeedsTwo("a", "b"), "tb text"))
    outcome = read_outcome(tmp_path, 0)
    assert outcome is not None and outcome.payload is not None  # it pickles: only loading it fails
    with pytest.raises(RankFailedError) as info:
        CallResult(raised=RankRaised(outcome, 1, (0,), "log")).load()
    assert info.value.exception_type is not None and info.value.exception_type.endswith("NeedsTwo")
    assert "a/b" in str(info.value) and info.value.remote_traceback == "tb text"


@pytest.mark.parametrize("data", [
    b"",
    b"\x80\x05garbage that a pickle reader would have loaded",
    OUTCOME_MAGIC + b"not json\n",
    OUTCOME_MAGIC + b"[1, 2]\n",
    _frame({"rank": 7, "ok": True, "payload_bytes": 1}, b"x"),  # another rank's
    _frame({"rank": 0, "ok": True, "payload_bytes": 5}, b"x"),  # sizes that do not match
    _frame({"rank": 0, "ok": True, "payload_bytes": None}),  # ok without a value
    _frame({"rank": 0, "ok": "yes", "payload_bytes": 1}, b"x"),
    _frame({"rank": 0, "ok": False, "payload_bytes": None, "exc_type": ["list"]}),
    _frame({"rank": 0, "ok": False, "payload_bytes": None, "traceback": "t" * (TRACEBACK_MAX_CHARS + 1)}),
    _frame({"rank": 0, "ok": False, "payload_bytes": None, "raised_at": "soon"}),
    OUTCOME_MAGIC + b"{" + b" " * (HEADER_MAX_BYTES + 10) + b"}\n",  # a header past its bound
])
def test_a_malformed_outcome_is_no_outcome(tmp_path: Path, data: bytes) -> None:
    outcome_path(tmp_path, 0).write_bytes(data)
    assert read_outcome(tmp_path, 0) is None


def test_a_value_past_the_servers_bound_is_the_ranks_error(tmp_path: Path) -> None:
    write_outcome(tmp_path, ok(0, b"x" * 4096))
    outcome = read_outcome(tmp_path, 0, max_payload_bytes=1024)
    assert outcome is not None and not outcome.ok and outcome.payload is None
    assert "more than the 1,024" in (outcome.exc_message or "") and "AIR_CHECKPOINT_DIR" in (outcome.exc_message or "")
    assert read_outcome(tmp_path, 0) is not None and read_outcome(tmp_path, 0).ok  # type: ignore[union-attr]


def test_long_texts_are_cut_to_their_bounds_keeping_the_raise(tmp_path: Path) -> None:
    write_outcome(tmp_path, error(0, ValueError("m" * 100_000), "frame\n" * 50_000 + "ValueError: the end"))
    outcome = read_outcome(tmp_path, 0)
    assert outcome is not None and outcome.traceback is not None and outcome.exc_message is not None
    assert outcome.traceback.endswith("ValueError: the end") and len(outcome.traceback) <= TRACEBACK_MAX_CHARS


def test_airs_own_errors_cross_as_typed_data(tmp_path: Path) -> None:
    hang = HangError("rank 1 made no progress", rank=1, silent_s=3.5, stacks="Thread 1 ...", hint="py-spy")
    vars(hang)["__notes__"] = ["a note"]  # what BaseException.add_note keeps (Python 3.11+)
    back = CallResult.from_bytes(b"".join(CallResult(error=hang).to_bytes())).error
    assert isinstance(back, HangError) and (back.rank, back.silent_s, back.stacks) == (1, 3.5, "Thread 1 ...")
    assert str(back) == str(hang) and getattr(back, "__notes__", None) == ["a note"]

    class Local(UserInputError):  # a subclass air.errors does not define: its nearest one that it does
        pass

    local = CallResult.from_bytes(b"".join(CallResult(error=Local("bad shape")).to_bytes())).error
    assert type(local) is UserInputError and local.exit_code == 2 and str(local) == "bad shape"
    other = CallResult.from_bytes(b"".join(CallResult(error=OSError("disk")).to_bytes())).error
    assert isinstance(other, WorkloadFailureException) and "OSError: disk" in str(other)


def test_a_result_names_only_air_errors_and_plain_data() -> None:
    forged: dict[str, object] = {"values": [], "raised": None,
              "error": {"class": "Exception", "message": "m", "hint": None, "state": {"x": {"nested": 1}}}}
    rebuilt = CallResult.from_bytes(b"AIR-CALL-RESULT 1\n" + json.dumps(forged).encode() + b"\n").error
    assert type(rebuilt) is WorkloadFailureException and not hasattr(rebuilt, "x")
    with pytest.raises(AirError, match="malformed"):
        CallResult.from_bytes(cloudpickle.dumps(("ok", [1])))  # an old server's answer: named, never loaded


def test_death_timeout_and_missing_outcomes_are_airs_errors(tmp_path: Path) -> None:
    logs = [tmp_path / "0.log", tmp_path / "1.log"]
    write_outcome(tmp_path, ok(0, 0))
    died = ProcessExit(index=1, name="rank 1", returncode=-9, ended_at=1.0, rank=1)
    with pytest.raises(RankFailedError, match="Rank 1 of 2 died"):
        settle([read_outcome(tmp_path, 0), None], [died], logs, timed_out=False, timeout_s=None)
    with pytest.raises(RankFailedError, match="Rank 1 ended without reporting"):
        settle([read_outcome(tmp_path, 0), None], [], logs, timed_out=False, timeout_s=None)
