"""benchmarks/bench_gpu_seeds.py is for GPU machines: without a GPU it must say so and stop (exit 2)."""

from __future__ import annotations

import pytest
from seed_helpers import ROOT, python


def test_gpu_benchmark_refuses_clearly_without_a_gpu() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the benchmark would run")
    result = python(ROOT / "benchmarks" / "bench_gpu_seeds.py", timeout=120)
    assert result.returncode == 2
    assert "has no usable GPU" in result.stdout and "--cpu-smoke" in result.stdout
