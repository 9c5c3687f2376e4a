"""The launcher's tests run their calls untracked: tracking has its own tests (tests/tracking*).

Why: with tracking on, every call here would leave a detached MLflow recorder behind, and with a fresh
AIR_HOME per test each one creates a new SQLite store (~6 s of CPU); up to 10 ran at once, loading the
2-core CI machine under the timing-sensitive teardown tests that follow.
"""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def untracked_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIR_TRACKING", "off")
