"""Tests marked `alone` run with no other test of the run beside them, on any pytest-xdist worker: they load
the machine on purpose (busy loops beside Ray's start-up), and their load must fail no neighbour's bounded
wait. tests/conftest.py installs this plugin; a pytest run outside the suite loads it with `-p alone_room`
(tests/ on PYTHONPATH), as tests/test_alone_room.py does.

Every test holds the run's "room" shared; an `alone` test holds it exclusively. A turnstile taken first
keeps further tests out while an `alone` test waits for the ones in the room to finish, so it is never
starved. The locks are taken outside pytest-timeout's wrapper (tryfirst): waiting for the room counts
against no test's timeout.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

#: The lock files, in the run's temporary folder.
TURNSTILE, ROOM = "alone-turnstile.lock", "alone-room.lock"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "alone: loads the machine on purpose; no other test of the run runs "
                                       "beside it (tests/alone_room.py)")


def room_folder(config: pytest.Config) -> Path:
    """The run's own temporary folder, which its xdist workers share (each worker's basetemp lies in it)
    and pytest removes with its old runs."""
    basetemp: Path = config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]
    return basetemp.parent if os.environ.get("PYTEST_XDIST_WORKER") else basetemp


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    folder = room_folder(item.config)
    alone = item.get_closest_marker("alone") is not None
    turnstile = os.open(folder / TURNSTILE, os.O_RDWR | os.O_CREAT, 0o600)
    room = os.open(folder / ROOM, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(room, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        yield
    finally:
        os.close(room)
        os.close(turnstile)
