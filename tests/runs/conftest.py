"""Fixtures for the run store tests: a fresh AIR_HOME per test and a clock that never needs sleep()."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from air.store.run_store import Run, RunStore


class StepClock:
    """Every read is one second later than the last: strict ordering without sleeping."""

    def __init__(self, start: float = 1_780_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


@pytest.fixture
def air_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "air-home"
    monkeypatch.setenv("AIR_HOME", str(home))
    return home


@pytest.fixture
def store(air_home: Path) -> Iterator[RunStore]:
    s = RunStore(clock=StepClock())
    yield s
    s.close()


@pytest.fixture
def make_run(store: RunStore) -> Callable[..., Run]:
    """A factory of PENDING runs with sensible defaults; keyword arguments go to create_run."""

    def make(**overrides: Any) -> Run:
        kwargs: dict[str, Any] = dict(
            experiment="exp", accelerator_type="CPU_2xCPU", num_accelerators=2, num_nodes=1, spec_yaml="x: 1\n"
        )
        kwargs.update(overrides)
        return store.create_run(**kwargs).run

    return make
