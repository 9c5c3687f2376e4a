"""tests/slurm run on one real 2-node Slurm cluster per test session (slurm_cluster.py), started on first use;
each test gets a `hpc` profile (`backend: slurm, partition: debug`) as its AIR_HOME's default, SLURM_CONF set."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from slurm_cluster import SlurmCluster


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def hpc(slurm_cluster: SlurmCluster, air_home: Path, monkeypatch: pytest.MonkeyPatch) -> SlurmCluster:
    """The cluster, empty, reached through this test's AIR_HOME's default profile `hpc`."""
    slurm_cluster.idle()
    monkeypatch.setenv("SLURM_CONF", str(slurm_cluster.conf))
    air_home.mkdir(parents=True, exist_ok=True)
    (air_home / "config.yaml").write_text(
        "default_profile: hpc\nprofiles:\n  hpc: {backend: slurm, partition: debug}\n")
    return slurm_cluster
