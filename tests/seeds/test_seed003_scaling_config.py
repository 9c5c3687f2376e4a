"""Seed 003: the document's ScalingConfig settings tried on a cluster ray_launch starts (CPU only here:
the node advertises 2 fake H100), and the table of what was scheduled and what was refused."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from seed_helpers import SEED003, processes_with_env, python, tail

pytestmark = pytest.mark.ray


def row(table: str, setting: str) -> str:
    lines = [line for line in table.splitlines() if line.startswith(setting)]
    assert len(lines) == 1, f"no single row for {setting!r} in:\n{table}"
    return lines[0]


@pytest.mark.timeout(600)  # a Ray cluster on 2 busy cores: minutes, not seconds
def test_quick_tour_prints_scheduled_and_refused_settings(air_home: Path) -> None:
    result = python(SEED003 / "scaling_config_tour.py", "--quick", "--fake-gpus", "2", timeout=500)
    assert result.returncode == 0, tail(result.stdout, 80)
    table = result.stdout[result.stdout.index("Cluster started by ray_launch"):]
    print(table)
    assert table.splitlines()[0] == "Cluster started by ray_launch: 2 GPU (H100, fake), 2 CPU"
    use_gpu = row(table, "use_gpu")
    assert "| scheduled |" in use_gpu and "GPU ids 0/1" in use_gpu and "NCCL_SOCKET_IFNAME=" in use_gpu
    several = row(table, "several GPUs per worker")
    assert "| scheduled |" in several and "devices cuda:0,cuda:1" in several
    fractional = row(table, "fractional GPUs")
    assert "| scheduled |" in fractional and re.search(r"GPU ids (\d)/\1;", fractional)  # two workers, one GPU
    a100 = row(table, "accelerator_type")
    assert "| refused   |" in a100 and "accelerator_type:A100" in a100 and "H100" in a100
    deprecated = row(table, "trainer_resources")
    assert "| refused   |" in deprecated and "deprecated" in deprecated
    assert not processes_with_env("AIR_CALL_DIR", lambda v: v.startswith(str(air_home)))
