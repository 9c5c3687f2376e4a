"""tests/slurm run on one real 2-node Slurm cluster per test session (slurm_cluster.py), started on first use;
each test gets a `hpc` profile (`backend: slurm, partition: debug`) as its AIR_HOME's default, SLURM_CONF set."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from slurm_cluster import SlurmCluster, shared_cluster


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    with shared_cluster() as cluster:
        yield cluster


@pytest.fixture(scope="session")
def slurm_netns_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """A second cluster whose slurmd each live in a network namespace of their own, with their own address."""
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm-netns"), netns=True)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def use(cluster: SlurmCluster, air_home: Path, monkeypatch: pytest.MonkeyPatch) -> SlurmCluster:
    """The cluster, empty, reached through this test's AIR_HOME's default profile `hpc`."""
    cluster.idle()
    monkeypatch.setenv("SLURM_CONF", str(cluster.conf))
    air_home.mkdir(parents=True, exist_ok=True)
    (air_home / "config.yaml").write_text(
        "default_profile: hpc\nprofiles:\n  hpc: {backend: slurm, partition: debug}\n")
    return cluster


@pytest.fixture
def hpc(slurm_cluster: SlurmCluster, air_home: Path, monkeypatch: pytest.MonkeyPatch) -> SlurmCluster:
    return use(slurm_cluster, air_home, monkeypatch)


@pytest.fixture
def hpc_netns(slurm_netns_cluster: SlurmCluster, air_home: Path, monkeypatch: pytest.MonkeyPatch) -> SlurmCluster:
    return use(slurm_netns_cluster, air_home, monkeypatch)
