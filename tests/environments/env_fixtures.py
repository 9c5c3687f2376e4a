"""Fixtures for the environment tests, imported by the test modules (under other names, so that
parameters do not shadow them). No conftest.py here: `from conftest import …` elsewhere in the suite
must always find tests/conftest.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from env_wheels import build_wheelhouse


@pytest.fixture(scope="session", name="wheelhouse")
def wheelhouse_fixture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The offline wheelhouse every install in these tests comes from."""
    return build_wheelhouse(tmp_path_factory.mktemp("wheelhouse"))


@pytest.fixture(scope="session", name="uv_cache")
def uv_cache_fixture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("uv-cache")


@pytest.fixture(autouse=True, name="offline_uv")
def offline_uv_fixture(monkeypatch: pytest.MonkeyPatch, uv_cache: Path) -> None:
    """No test may reach an index: uv runs offline, with a cache of its own."""
    monkeypatch.setenv("UV_OFFLINE", "1")
    monkeypatch.setenv("UV_CACHE_DIR", str(uv_cache))
    for name in ("UV_INDEX_URL", "UV_DEFAULT_INDEX", "UV_EXTRA_INDEX_URL", "UV_FIND_LINKS", "UV_NO_INDEX",
                 "UV_INDEX", "PIP_INDEX_URL"):
        monkeypatch.delenv(name, raising=False)
