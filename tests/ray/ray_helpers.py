"""Helpers shared by the Ray tests (a unique module name: test folders are not packages)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(predicate: Callable[[], object], what: str, timeout: float = 10.0, interval: float = 0.1) -> object:
    """Poll until `predicate()` is truthy; fail with the last value seen, never a bare sleep."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last seen: {last!r}")


def never() -> bool:
    return False
