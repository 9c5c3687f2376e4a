"""Fixtures of the air server tests (the server itself: server_helpers.py).

A test that needs a server with users alice, bob and root, but not a fresh one, takes a shared one:
`shared_server` (one per module and worker) or `isolated_server` (an isolated root server, one per worker).
A test that restarts or stops its server, changes its configuration, or asserts on everything the server
holds (every run, every upload, every environment) takes `server` (or starts its own): it gets a fresh one.
Tests of a shared server keep to their own runs (each asserts on the runs it made, or on the newest), so
their assertions hold whichever tests ran on it before."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from server_helpers import PRIVATE, AirServer, running_isolated_server, running_server

from tracking_choice import tracks


@pytest.fixture(autouse=True)
def _bubblewrap(bubblewrap_installed: None) -> None:
    """Every server test may start an isolated server: bubblewrap must be there (installed where missing)."""


@pytest.fixture
def server(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[AirServer]:
    """A started server with users alice, bob and root (admin); stopped with SIGTERM afterwards, and no
    process of its home may survive. `@pytest.mark.parametrize("server", ["mlflow"], indirect=True)`
    also gives it its MLflow server."""
    with running_server(tmp_path, mlflow=getattr(request, "param", None) == "mlflow", tracking=tracks(request)) as srv:
        yield srv


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory, bubblewrap_installed: None,
                  request: pytest.FixtureRequest) -> Iterator[AirServer]:
    """`server`, started once for the module's tests that only need one (each start costs seconds of CPU);
    afterwards no process of its home may survive, as for `server`."""
    with running_server(tmp_path_factory.mktemp("shared-server"), tracking=tracks(request)) as srv:
        yield srv


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory, bubblewrap_installed: None) -> Iterator[AirServer]:
    """`server` with its MLflow server, started once per worker for the tests that only log to it and read
    back their own runs; afterwards no process of its home may survive."""
    with running_server(tmp_path_factory.mktemp("mlflow-server"), mlflow=True, tracking=True) as srv:
        yield srv


@pytest.fixture(scope="session")
def private_mlflow_server(tmp_path_factory: pytest.TempPathFactory, bubblewrap_installed: None) -> Iterator[AirServer]:
    """A server with its MLflow (the door in front of it) whose runs are private by default, started once
    per worker for the MLflow door's tests; afterwards no process of its home may survive."""
    with running_server(tmp_path_factory.mktemp("private-mlflow"), mlflow=True, config=PRIVATE, tracking=True) as srv:
        yield srv


@pytest.fixture(scope="session")
def isolated_server(tmp_path_factory: pytest.TempPathFactory, bubblewrap_installed: None) -> Iterator[AirServer]:
    """An isolated root server (`unix-user+bwrap`, no MLflow, default configuration), started once per
    worker for every test that only needs one; afterwards no process of its home may survive."""
    with running_isolated_server(tmp_path_factory.mktemp("isolated-server"), tracking=True) as srv:
        yield srv
