"""Fixtures of the air server tests (the server itself: server_helpers.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from server_helpers import AirServer, running_server


@pytest.fixture(autouse=True)
def _bubblewrap(bubblewrap_installed: None) -> None:
    """Every server test may start an isolated server: bubblewrap must be there (installed where missing)."""


@pytest.fixture
def server(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[AirServer]:
    """A started server with users alice, bob and root (admin); stopped with SIGTERM afterwards, and no
    process of its home may survive. `@pytest.mark.parametrize("server", ["mlflow"], indirect=True)`
    also gives it its MLflow server."""
    with running_server(tmp_path, mlflow=getattr(request, "param", None) == "mlflow") as srv:
        yield srv
