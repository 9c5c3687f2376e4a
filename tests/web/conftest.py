"""Browser tests of the web pages: Debian's chromium driven through its chromedriver (Selenium), against
the pages served by uvicorn on loopback over a real run store with real runs."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workload_runs"))

from web_helpers import free_port, headless_chromium  # noqa: E402


@pytest.fixture
def browser(chromium_installed: None) -> Iterator[object]:
    """A fresh headless chromium (its own profile folder) per test."""
    with headless_chromium() as driver:
        yield driver


@pytest.fixture
def serve(air_home: Path) -> Iterator[Callable[..., str]]:
    """Serve `create_web_app(**kwargs)` over this test's AIR_HOME on a free loopback port; returns its URL."""
    from air.web import create_web_app
    from air.web.serve import PageServer

    servers: list[PageServer] = []

    def start(**kwargs: object) -> str:
        port = free_port()
        server = PageServer(create_web_app(**kwargs), "127.0.0.1", port)  # type: ignore[arg-type]
        server.start()
        servers.append(server)
        return f"http://127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def cpu_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    """Enough CPU slots for the runs of one test at once, and no MLflow start-up per run on 2 cores."""
    monkeypatch.setenv("AIR_CPU_SLOTS", "8")
    monkeypatch.setenv("AIR_TRACKING", "off")
