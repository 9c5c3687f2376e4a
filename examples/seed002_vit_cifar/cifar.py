"""What the tutorial's three steps share: torchvision (or its marked fallback), the data loaders, the
ViT's size, and the settings a self-hosted run changes.

Settings (environment variables, so a workload's `env_variables` or `--override` can set them):

| variable | default (the tutorial's) | offline / CI |
|---|---|---|
| CIFAR10_ROOT | `~/data` | a folder from `make_fake_cifar.py` |
| CIFAR10_DOWNLOAD | `1` (download CIFAR-10) | `0` |
| CIFAR10_PARQUET | `s3://ray-example-data/cifar10-parquet` | `<root>/cifar10-parquet` |
| VIT_SIZE | `tutorial` (12 layers, 8 heads, 384 hidden, 768 MLP) | `tiny` (2, 4, 64, 128) |
| EPOCHS, LR, GLOBAL_BATCH_SIZE | 1, 1e-3, 512 | smaller batches for tiny data |
| NUM_WORKERS, USE_GPU | 8, 1 (steps 2 and 3) | 2, 0 |
| RAY_STORAGE_PATH | Ray's default (`~/ray_results`); the tutorial's `/mnt/cluster_storage` is Anyscale's | a temp folder |
"""

from __future__ import annotations

import os
from typing import Any

import torch
from filelock import FileLock
from torch.utils.data import DataLoader

try:  # the real thing whenever it imports (a torchvision built for this torch)
    from torchvision import datasets, transforms
    from torchvision.models import VisionTransformer
    from torchvision.transforms import Normalize, ToTensor

    USING_TORCHVISION = True
except Exception:  # noqa: BLE001 - ImportError, or a torchvision built for another torch failing to load
    from torchvision_fallback import Normalize, ToTensor, VisionTransformer, datasets, transforms

    USING_TORCHVISION = False

VIT_SIZES: dict[str, dict[str, int]] = {
    "tutorial": {"num_layers": 12, "num_heads": 8, "hidden_dim": 384, "mlp_dim": 768},
    "tiny": {"num_layers": 2, "num_heads": 4, "hidden_dim": 64, "mlp_dim": 128},
}
DEFAULT_PARQUET = "s3://ray-example-data/cifar10-parquet"
#: The settings above that code running on Ray's workers reads (the driver passes them on).
WORKER_SETTINGS = ("CIFAR10_ROOT", "CIFAR10_DOWNLOAD", "VIT_SIZE", "TQDM_DISABLE")


def env(name: str, default: Any) -> Any:
    """An environment setting, typed like its default."""
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    if isinstance(default, bool):
        return value.lower() in ("1", "true", "yes")
    return type(default)(value)


def backend_note() -> str:
    return "torchvision" if USING_TORCHVISION else "torchvision_fallback (torchvision is not importable here)"


def make_vit() -> torch.nn.Module:
    """The tutorial's VisionTransformer; VIT_SIZE picks the tutorial's size or a tiny one."""
    size = VIT_SIZES[env("VIT_SIZE", "tutorial")]
    return VisionTransformer(
        image_size=32,  # CIFAR-10 image size is 32x32
        patch_size=4,  # Patch size is 4x4
        num_layers=size["num_layers"],  # Number of transformer layers
        num_heads=size["num_heads"],  # Number of attention heads
        hidden_dim=size["hidden_dim"],  # Hidden size (can be adjusted)
        mlp_dim=size["mlp_dim"],  # MLP dimension (can be adjusted)
        num_classes=10,  # CIFAR-10 has 10 classes
    )


def cifar10(root: str, train: bool, download: bool, transform: Any) -> Any:
    """`datasets.CIFAR10(...)`; a generated set (make_fake_cifar.py) is read by the same reader with
    torchvision's MD5 check relaxed to "the files are there": generated files cannot match real sums."""
    generated = os.path.exists(os.path.join(os.path.expanduser(root), "cifar-10-batches-py", "GENERATED"))
    if USING_TORCHVISION and generated:
        import pickle

        class GeneratedCIFAR10(datasets.CIFAR10):
            def _check_integrity(self) -> bool:
                base = os.path.join(str(self.root), self.base_folder)
                return all(os.path.exists(os.path.join(base, name)) for name, _ in self.train_list + self.test_list)

            def _load_meta(self) -> None:  # older torchvision checks the meta file's MD5 here too
                with open(os.path.join(str(self.root), self.base_folder, self.meta["filename"]), "rb") as fh:
                    self.classes = pickle.load(fh, encoding="latin1")[self.meta["key"]]
                self.class_to_idx = {name: i for i, name in enumerate(self.classes)}

        return GeneratedCIFAR10(root=root, train=train, download=False, transform=transform)
    return datasets.CIFAR10(root=root, train=train, download=download, transform=transform)


def get_dataloaders(batch_size):
    # Transform to normalize the input images.
    transform = transforms.Compose([ToTensor(), Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))])
    root = env("CIFAR10_ROOT", "~/data")
    download = env("CIFAR10_DOWNLOAD", True)

    with FileLock(os.path.expanduser(f"{root.rstrip('/')}.lock")):  # the tutorial's "~/data.lock"
        # Download training data from open datasets.
        training_data = cifar10(root, train=True, download=download, transform=transform)
        # Download test data from open datasets.
        testing_data = cifar10(root, train=False, download=download, transform=transform)

    # Create data loaders.
    train_dataloader = DataLoader(training_data, batch_size=batch_size, shuffle=True)
    test_dataloader = DataLoader(testing_data, batch_size=batch_size)

    return train_dataloader, test_dataloader


def runtime_env(folder: str) -> dict[str, Any]:
    """The Ray job's runtime_env: this folder as working_dir (the workers import cifar.py from it) and
    the settings the workers read, so a cluster started elsewhere sees what this driver was given."""
    return {"working_dir": folder, "excludes": ["*.md", "__pycache__"],
            "env_vars": {name: os.environ[name] for name in WORKER_SETTINGS if name in os.environ}}


def storage_path() -> str | None:
    """Where Ray Train keeps checkpoints: RAY_STORAGE_PATH, else the air run's checkpoint folder (kept
    across its attempts: AIR_CHECKPOINT_DIR), else Ray's default (~/ray_results)."""
    return os.environ.get("RAY_STORAGE_PATH") or os.environ.get("AIR_CHECKPOINT_DIR") or None


def run_name(prefix: str) -> str:
    """The Ray Train run's name: the same in every attempt of an air run (so a retry resumes), else fresh."""
    import uuid

    return f"{prefix}-{os.environ.get('AIR_RUN_ID') or uuid.uuid4().hex}"


def load_checkpoint(model):
    """A retried attempt: load the last checkpoint (`ray.train.get_checkpoint()`) into `model` and return
    the epoch to start from; 0 when there is none."""
    import ray.train
    import torch

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return 0
    with checkpoint.as_directory() as folder:
        model.load_state_dict(torch.load(os.path.join(folder, "model.pt"), map_location="cpu", weights_only=True))
        epoch_file = os.path.join(folder, "epoch")
        done = int(open(epoch_file).read()) if os.path.exists(epoch_file) else -1
    print(f"resumed from the checkpoint of epoch {done}", flush=True)
    return done + 1
