"""Fixtures of the seed tests: a generated CIFAR-shaped data set, and one small Ray cluster (head only)
for the programs that expect a cluster to be there (seed 002 steps 2 and 3), stopped at the end."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # seed_helpers, for conftest's own imports

from seed_helpers import SEED002  # noqa: E402


@pytest.fixture(scope="session")
def fake_cifar(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """CIFAR-10's pickle batches and the Parquet copy, 256 train / 64 test images."""
    sys.path.insert(0, str(SEED002))
    try:
        from make_fake_cifar import make_fake_cifar
    finally:
        sys.path.remove(str(SEED002))
    return make_fake_cifar(tmp_path_factory.mktemp("cifar"), train=256, test=64)


@pytest.fixture(scope="module")
def ray_head() -> Iterator[dict[str, str]]:
    """A one-node Ray cluster of this test module (4 logical CPUs: 2 training workers + Ray Data tasks),
    with its own ports, temp dir and token; yields the environment a driver needs to reach it."""
    from air.ray.cluster import RayAuth, start_ray_node

    node = start_ray_node(head=True, num_cpus=4, object_store_memory=200 * 1024 * 1024,
                          auth=RayAuth.new_token(), include_dashboard=True)
    try:
        yield {**node.auth.env(), "RAY_ADDRESS": node.address}
    finally:
        node.stop(grace_s=2.0)
        assert not node.processes(), "the test cluster left processes behind"


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
