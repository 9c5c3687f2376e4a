"""The decorator's surface: spellings, validation messages, direct calls, overrides."""

from __future__ import annotations

import subprocess
import sys

import pytest

from air import distributed
from air.accelerators import GpuDevice, MachineAccelerators
from air.distributed.shape import check_settings, resolve_local
from air.errors import GPUTypeError, GPUValidationError, RuntimeConfigurationError


def train(lr: float, epochs: int = 2) -> float:
    return lr * epochs


def test_both_import_paths_are_the_same_object() -> None:
    import serverless_gpu
    import serverless_gpu.runtime
    from air import runtime

    assert serverless_gpu.distributed is distributed
    assert serverless_gpu.runtime.get_global_rank is runtime.get_global_rank


def test_direct_call_says_what_to_call() -> None:
    fn = distributed(num_accelerators=2, accelerator_type="CPU")(train)
    with pytest.raises(RuntimeConfigurationError, match=r"train\.distributed\(\.\.\.\).*train\.func"):
        fn(0.1)
    assert fn.func(0.5) == 1.0
    assert fn.__name__ == "train"


def test_old_and_new_spellings_but_not_both() -> None:
    assert distributed(gpus=8, gpu_type="A10")(train).num_accelerators == 8
    assert distributed(num_accelerators=4, accelerator_type="H100")(train).accelerator_type == "H100"
    with pytest.raises(RuntimeConfigurationError, match="either gpus= or num_accelerators="):
        distributed(gpus=2, num_accelerators=2)
    with pytest.raises(RuntimeConfigurationError, match="either gpu_type= or accelerator_type="):
        distributed(gpu_type="A10", accelerator_type="A10")


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, "2"])
def test_count_must_be_a_positive_int(bad: object) -> None:
    with pytest.raises(RuntimeConfigurationError, match="positive integer"):
        distributed(num_accelerators=bad)


@pytest.mark.parametrize("bad", [0, -5, True, "10", float("inf")])
def test_timeout_must_be_positive_or_none(bad: object) -> None:
    with pytest.raises(RuntimeConfigurationError, match="timeout"):
        distributed(timeout=bad)
    assert distributed(timeout=None)(train).timeout is None


def test_with_overrides_clones_and_revalidates() -> None:
    base = distributed(gpus=8, gpu_type="H100", timeout=60)(train)
    cpu = base.with_overrides(num_accelerators=2, accelerator_type="CPU")
    assert (cpu.num_accelerators, cpu.accelerator_type, cpu.timeout) == (2, "CPU", 60.0)
    assert (base.num_accelerators, base.accelerator_type) == (8, "H100")
    assert base.with_overrides(timeout=None).timeout is None
    assert base.with_overrides(gpus=4).num_accelerators == 4
    assert "num_accelerators=8" in repr(base) and "func=train" in repr(base)
    with pytest.raises(RuntimeConfigurationError):
        base.with_overrides(num_accelerators=0)


def test_unknown_type_is_refused() -> None:
    with pytest.raises(GPUTypeError, match="Unknown accelerator type 'Z80'"):
        resolve_local(check_settings(2, "Z80"), MachineAccelerators((), 2))


def test_no_gpu_says_how_to_run_on_cpu() -> None:
    with pytest.raises(GPUValidationError) as info:
        resolve_local(check_settings(8, "A10"), MachineAccelerators((), 2))
    assert "no GPU" in str(info.value) and "accelerator_type='CPU'" in str(info.value)


def test_more_gpus_than_the_machine_has() -> None:
    machine = MachineAccelerators(tuple(GpuDevice(i, str(i), "NVIDIA H100 80GB HBM3") for i in range(2)), 16)
    with pytest.raises(GPUValidationError) as info:
        resolve_local(check_settings(8, "H100"), machine)
    message = str(info.value)
    assert "8 GPUs" in message and "2 × H100" in message and "accelerator_type='CPU'" in message
    with pytest.raises(GPUTypeError, match="asked for A10 GPUs but this machine has 2 × H100".replace("asked", "Asked")):
        resolve_local(check_settings(1, "a10"), machine)
    shape = resolve_local(check_settings(None, "GPU_8xH100"), machine)
    assert (shape.world_size, shape.gpu_ids, shape.accelerator.name) == (2, ("0", "1"), "GPU_2xH100")


def test_cpu_slots_bound_cpu_ranks() -> None:
    with pytest.raises(GPUValidationError, match="AIR_CPU_SLOTS"):
        resolve_local(check_settings(5, "cpu"), MachineAccelerators((), 4))
    assert resolve_local(check_settings(None, "CPU"), MachineAccelerators((), 4)).world_size == 4


def test_too_many_cpu_ranks_is_refused_without_a_gpu_query(monkeypatch: pytest.MonkeyPatch) -> None:
    """The path of a real call (no machine passed in): only the CPU slots are read."""
    monkeypatch.setenv("AIR_CPU_SLOTS", "3")
    with pytest.raises(GPUValidationError) as info:
        distributed(num_accelerators=5, accelerator_type="CPU")(lambda: 0).distributed()
    assert "5 CPU processes" in str(info.value) and "3 CPU slots" in str(info.value)
    assert "num_accelerators <= 3" in str(info.value) and "AIR_CPU_SLOTS=5" in str(info.value)


def test_gpu_discovery_honours_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    from air import accelerators

    rows = [(0, "GPU-aaaa", "NVIDIA A10G"), (1, "GPU-bbbb", "NVIDIA A10G"), (2, "GPU-cccc", "NVIDIA A10G")]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert [r[0] for r in accelerators._visible_filter(rows)] == [2, 0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-bbbb")
    assert [r[0] for r in accelerators._visible_filter(rows)] == [1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert accelerators._visible_filter(rows) == []
    assert accelerators.normalize_model("NVIDIA H100 80GB HBM3") == "H100"
    assert accelerators.normalize_model("NVIDIA A10G") == "A10"
    assert accelerators.normalize_model("h100_80gb") == "H100"


def test_remote_without_a_configured_profile_runs_on_this_machine() -> None:
    """No profile configured: remote=True runs on the local profile (issue 13), one value per rank."""
    fn = distributed(num_accelerators=2, accelerator_type="CPU", remote=True)(train)
    assert fn.distributed(0.1) == [0.2, 0.2]


def test_wrong_arguments_fail_before_anything_starts(air_home) -> None:
    fn = distributed(num_accelerators=2, accelerator_type="CPU")(train)
    with pytest.raises(TypeError, match=r"train\.distributed\(\)"):
        fn.distributed(0.1, 2, 3)
    assert not (air_home / "runs").exists()  # no run was made


def test_importing_air_does_not_import_torch_or_mlflow() -> None:
    code = "import sys, air, serverless_gpu, air.runtime; print(sorted(m for m in ('torch','mlflow','ray') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
