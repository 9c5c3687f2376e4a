"""Seed 002: the ViT/CIFAR-10 tutorial's three steps on CPU, with a generated CIFAR-shaped data set:
step 1 as an air workload, steps 2 (Ray Train) and 3 (Ray Data) as drivers on a running Ray cluster."""

from __future__ import annotations

import json
import pickle
import re
import sys
from pathlib import Path

import pytest
from seed_helpers import SEED002, air_cli, python, tail

TINY = {"VIT_SIZE": "tiny", "EPOCHS": "1", "LR": "3e-3", "GLOBAL_BATCH_SIZE": "64", "CIFAR10_DOWNLOAD": "0",
        "NUM_WORKERS": "2", "USE_GPU": "0"}


def test_generated_set_has_cifar10s_layouts_and_the_fallback_reads_it(fake_cifar: Path) -> None:
    batches = fake_cifar / "cifar-10-batches-py"
    with open(batches / "data_batch_1", "rb") as fh:
        entry = pickle.load(fh, encoding="latin1")  # how torchvision reads it
    assert entry["data"].shape[1] == 3072 and entry["data"].dtype.name == "uint8"
    assert set(entry) >= {"data", "labels", "filenames", "batch_label"}
    sys.path.insert(0, str(SEED002))
    try:
        from torchvision_fallback import CIFAR10, VisionTransformer, transforms

        data = CIFAR10(str(fake_cifar), train=True, transform=transforms.Compose(
            [transforms.ToTensor(), transforms.Normalize((0.5,) * 3, (0.5,) * 3)]))
        image, label = data[0]
        assert len(data) == 256 and image.shape == (3, 32, 32) and 0 <= label < 10
        assert -1.0 <= float(image.min()) and float(image.max()) <= 1.0
        model = VisionTransformer(image_size=32, patch_size=4, num_layers=2, num_heads=4, hidden_dim=64,
                                  mlp_dim=128, num_classes=10)
        assert model(image[None]).shape == (1, 10)
        names = {name for name, _ in model.state_dict().items()}  # torchvision's parameter names
        assert {"class_token", "conv_proj.weight", "encoder.pos_embedding", "heads.head.weight",
                "encoder.layers.encoder_layer_1.mlp.3.weight", "encoder.ln.bias"} <= names
        with pytest.raises(RuntimeError, match="make_fake_cifar.py"):
            CIFAR10(str(fake_cifar / "nowhere"), download=True)
    finally:
        sys.path.remove(str(SEED002))
        for module in ("torchvision_fallback",):
            sys.modules.pop(module, None)
    import pyarrow.parquet as pq

    table = pq.read_table(fake_cifar / "cifar10-parquet" / "test")
    assert table.num_rows == 64 and table.column_names == ["image", "label"]


#: workload_cpu.yaml's node flags in place of `--num-gpus="$GPUS_PER_NODE"` (no GPU in CI; Ray Data's
#: tasks need CPUs besides the training workers', so RAY_NODE_NUM_CPUS, not the slot count).
CPU_FLAGS = "--num-cpus=$RAY_NODE_NUM_CPUS --num-gpus=0 --object-store-memory=200000000"


def test_cpu_yaml_runs_the_gpu_yaml_command_after_its_offline_prelude() -> None:
    """Seed 000's Ray commands (port 6379, `ray stop`, the joining loop), which air's `ray` shim makes
    safe on a shared machine: the CPU variant differs from workload.yaml only in its prelude and devices."""
    import yaml

    def ray_part(name: str) -> list[str]:
        lines = yaml.safe_load((SEED002 / name).read_text())["command"].splitlines()
        return [line for line in lines[lines.index('if [ "$STEP" = "1" ]; then'):]
                if not line.strip().startswith("#")]

    gpu = [line.replace('--num-gpus="$GPUS_PER_NODE"', CPU_FLAGS).replace("GPU(s)", "CPU(s)")
           for line in ray_part("workload.yaml")]
    assert ray_part("workload_cpu.yaml") == gpu, "workload_cpu.yaml's command drifted from workload.yaml's"
    assert "ray stop" in [line.strip() for line in gpu]
    assert not (SEED002 / "ray_node_args.py").exists()


def test_step1_as_a_workload(air_home: Path) -> None:
    result = air_cli("run", "-f", str(SEED002 / "workload_cpu.yaml"), "--watch", "--json",
                     "--override", "env_variables.STEP=1", "--override", "env_variables.EPOCHS=2", timeout=400)
    events = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    log = "\n".join(e["line"] for e in events if e.get("type") == "LOG")
    assert result.returncode == 0, tail(result.stdout, 80)
    assert events[-1]["status"] == "SUCCESS"
    assert "step 1: single machine" in log and "'epoch_num': 1" in log, log


def accuracies(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"'accuracy': ([0-9.]+)", text)]


@pytest.mark.ray
@pytest.mark.timeout(600)  # a Ray cluster on 2 busy cores: minutes, not seconds
def test_step2_ray_train_on_a_running_cluster(ray_head: dict[str, str], fake_cifar: Path, tmp_path: Path) -> None:
    env = {**ray_head, **TINY, "CIFAR10_ROOT": str(fake_cifar), "RAY_STORAGE_PATH": str(tmp_path / "results")}
    result = python(SEED002 / "step2_ray_train.py", env=env, timeout=400)
    assert result.returncode == 0, tail(result.stdout, 80)
    assert "Training result: Result(metrics={'loss'" in result.stdout
    assert "world_rank=1" in result.stdout  # two Ray Train workers, DDP
    assert accuracies(result.stdout), tail(result.stdout)
    assert list((tmp_path / "results").glob("train_run-*/checkpoint_*/model.pt"))  # ray.train.report checkpoints


@pytest.mark.ray
@pytest.mark.timeout(600)  # a Ray cluster on 2 busy cores: minutes, not seconds
def test_step3_ray_data_on_a_running_cluster(ray_head: dict[str, str], fake_cifar: Path, tmp_path: Path) -> None:
    env = {**ray_head, **TINY, "CIFAR10_PARQUET": str(fake_cifar / "cifar10-parquet"),
           "RAY_STORAGE_PATH": str(tmp_path / "results")}
    result = python(SEED002 / "step3_ray_data.py", env=env, timeout=400)
    assert result.returncode == 0, tail(result.stdout, 80)
    assert re.search(r"image\s+ArrowTensorType\w*\(shape=\(32, 32, 3\), dtype=uint8\)", result.stdout)  # schema()
    assert "Training result: Result(metrics={'loss'" in result.stdout
    assert list((tmp_path / "results").glob("train_data_run-*/checkpoint_*/model.pt"))
