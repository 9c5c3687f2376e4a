"""Browser tests of the web pages: Debian's chromium driven through its chromedriver (Selenium), against
the pages served by uvicorn on loopback over a real run store with real runs."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workload_runs"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))

from server_helpers import AIR, AirServer, running_server
from web_helpers import free_port, headless_chromium


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AirServer]:
    """One plain-HTTP `air server` (users alice, bob, root) for a module's page tests; its runs go without
    MLflow so they start fast. A test that failed half-way leaves no run running."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AIR_TRACKING", "off")
        with running_server(tmp_path_factory.mktemp("pages")) as server:
            try:
                yield server
            finally:
                subprocess.run([*AIR, "cancel", "--all", "-y"], env=server.server_env(), capture_output=True,
                               timeout=300)


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
