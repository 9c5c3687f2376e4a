"""Timing shared by the benchmark scripts."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def median_ms(fn: Callable[[], Any], repeat: int) -> float:
    """Median wall time of `fn()` over `repeat` calls, in milliseconds."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def wait_file(path: Path, timeout: float = 120.0) -> float:
    """The number a benchmarked process writes to `path` (its clock at a moment it marks), once it is there."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            text = path.read_text().strip()
            if text:
                return float(text)
        except FileNotFoundError:
            pass
        time.sleep(0.005)
    raise TimeoutError(f"{path} never appeared")
