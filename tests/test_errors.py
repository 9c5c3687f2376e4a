"""Every AirError crosses process boundaries (a rank's, the supervisor's): each one pickles whole."""

from __future__ import annotations

import inspect
import pickle

import pytest

import air.errors as errors

ERRORS = [getattr(errors, name) for name in errors.__all__]


@pytest.mark.parametrize("cls", ERRORS, ids=lambda c: c.__name__)
def test_every_air_error_round_trips_through_pickle(cls: type[errors.AirError]) -> None:
    params = inspect.signature(cls.__init__).parameters
    extra = {name: 7 if name in ("rank", "node", "exit_code") else f"{name}-value"
             for name, p in params.items() if p.kind is p.KEYWORD_ONLY and name != "hint"}
    err = cls("what went wrong", hint="what to do", **extra) if "hint" in params or cls is errors.AirError \
        else cls("what went wrong")
    clone = pickle.loads(pickle.dumps(err))
    assert type(clone) is cls and str(clone) == str(err) and clone.__dict__ == err.__dict__


def test_hang_error_keeps_the_rank_and_its_stacks() -> None:
    err = errors.HangError("Hang: rank 1 made no progress for 5m", rank=1, node=0, silent_s=300.0,
                           stacks="Thread 1 (idle): all_reduce", stacks_path="/x/rank_1.stacks.txt")
    clone = pickle.loads(pickle.dumps(err))
    assert (clone.rank, clone.node, clone.silent_s, clone.stacks) == (1, 0, 300.0, "Thread 1 (idle): all_reduce")
    assert clone.code == "HANG" and clone.exit_code == 1
