"""benchmarks/bench_gpu_seeds.py is for GPU machines: without a GPU it must say so and stop (exit 2)."""

from __future__ import annotations

from seed_helpers import ROOT, python


def test_gpu_benchmark_refuses_clearly_without_a_gpu() -> None:
    # No visible GPU, on any machine (a GPU machine too): the refusal is what is under test.
    result = python(ROOT / "benchmarks" / "bench_gpu_seeds.py", env={"CUDA_VISIBLE_DEVICES": ""}, timeout=120)
    assert result.returncode == 2
    assert "has no usable GPU" in result.stdout and "--cpu-smoke" in result.stdout
