"""Fixtures of the seed tests: a generated CIFAR-shaped data set, and the session's Ray cluster for the
programs that expect a cluster to be there (seed 002 steps 2 and 3)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # seed_helpers, for conftest's own imports

from seed_helpers import SEED002

if TYPE_CHECKING:
    from conftest import RayTestCluster  # tests/conftest.py's (this file is a conftest too)


@pytest.fixture(scope="session")
def fake_cifar(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """CIFAR-10's pickle batches and the Parquet copy, 256 train / 64 test images."""
    sys.path.insert(0, str(SEED002))
    try:
        from make_fake_cifar import make_fake_cifar
    finally:
        sys.path.remove(str(SEED002))
    return make_fake_cifar(tmp_path_factory.mktemp("cifar"), train=256, test=64)


@pytest.fixture
def ray_head(ray_cluster: RayTestCluster) -> dict[str, str]:
    """The environment a driver needs to reach the session's Ray cluster (tests/conftest.py, shared with
    tests/ray): Ray Train's workers and Ray Data's tasks spread over its nodes' CPUs."""
    return ray_cluster.driver_env()


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
