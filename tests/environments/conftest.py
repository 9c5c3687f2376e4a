"""Fixtures for environment tests: an offline wheelhouse built once per session, uv kept offline."""

from __future__ import annotations

from pathlib import Path

import pytest
from wheelhouse import build_wheelhouse


@pytest.fixture(scope="session")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wheelhouse(tmp_path_factory.mktemp("wheelhouse"))


@pytest.fixture(scope="session")
def uv_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("uv-cache")


@pytest.fixture(autouse=True)
def offline_uv(monkeypatch: pytest.MonkeyPatch, uv_cache: Path) -> None:
    """No test may reach an index: uv runs offline, with a cache of its own."""
    monkeypatch.setenv("UV_OFFLINE", "1")
    monkeypatch.setenv("UV_CACHE_DIR", str(uv_cache))
    for name in ("UV_INDEX_URL", "UV_EXTRA_INDEX_URL", "UV_FIND_LINKS", "UV_NO_INDEX", "PIP_INDEX_URL"):
        monkeypatch.delenv(name, raising=False)
