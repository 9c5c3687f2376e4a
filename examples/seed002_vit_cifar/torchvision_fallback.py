"""FALLBACK ONLY: small stand-ins for the parts of torchvision the tutorial uses, for machines where
torchvision cannot be imported (CI runs a CPU torch build that PyPI's torchvision does not match).

When `import torchvision` works, `cifar.py` uses torchvision itself and nothing here runs. The
stand-ins keep torchvision's constructor arguments and behaviour for what the tutorial touches:

- `VisionTransformer(image_size, patch_size, num_layers, num_heads, hidden_dim, mlp_dim, dropout=0.0,
  attention_dropout=0.0, num_classes=1000, representation_size=None, norm_layer=...)`: the same
  architecture (patchify conv, class token, learned position embedding, pre-norm encoder blocks with
  `nn.MultiheadAttention` and a GELU MLP, final LayerNorm, linear head) with the same parameter names,
  so a state dict saved from one loads into the other. `conv_stem_configs` is not supported.
- `datasets.CIFAR10(root, train=True, transform=None, target_transform=None, download=False)`: reads
  the `cifar-10-batches-py` pickle batches under `root`, items are (HWC uint8 array, label). It cannot
  download (no internet is the reason it exists): it says so when the files are missing.
- `transforms.Compose`, `ToTensor` (HWC uint8 → CHW float in [0, 1]) and `Normalize`.
"""

from __future__ import annotations

import math
import os
import pickle
from collections import OrderedDict
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np
import torch
from torch import nn

# -- models ---------------------------------------------------------------------------------------------


class _MLPBlock(nn.Sequential):
    """Linear → GELU → Dropout → Linear → Dropout, indexed 0..4 like torchvision's MLPBlock."""

    def __init__(self, in_dim: int, mlp_dim: int, dropout: float) -> None:
        super().__init__(nn.Linear(in_dim, mlp_dim), nn.GELU(), nn.Dropout(dropout),
                         nn.Linear(mlp_dim, in_dim), nn.Dropout(dropout))
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.normal_(module.bias, std=1e-6)


class _EncoderBlock(nn.Module):
    """Pre-norm transformer block: x + attention(ln_1(x)), then + mlp(ln_2(·))."""

    def __init__(self, num_heads: int, hidden_dim: int, mlp_dim: int, dropout: float, attention_dropout: float,
                 norm_layer: Callable[..., nn.Module]) -> None:
        super().__init__()
        self.ln_1 = norm_layer(hidden_dim)
        self.self_attention = nn.MultiheadAttention(hidden_dim, num_heads, dropout=attention_dropout,
                                                    batch_first=True)
        self.dropout = nn.Dropout(dropout)
        self.ln_2 = norm_layer(hidden_dim)
        self.mlp = _MLPBlock(hidden_dim, mlp_dim, dropout)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        x = self.ln_1(inputs)
        x, _ = self.self_attention(x, x, x, need_weights=False)
        x = self.dropout(x) + inputs
        return x + self.mlp(self.ln_2(x))


class _Encoder(nn.Module):
    def __init__(self, seq_length: int, num_layers: int, num_heads: int, hidden_dim: int, mlp_dim: int,
                 dropout: float, attention_dropout: float, norm_layer: Callable[..., nn.Module]) -> None:
        super().__init__()
        self.pos_embedding = nn.Parameter(torch.empty(1, seq_length, hidden_dim).normal_(std=0.02))
        self.dropout = nn.Dropout(dropout)
        self.layers = nn.Sequential(OrderedDict(
            (f"encoder_layer_{i}", _EncoderBlock(num_heads, hidden_dim, mlp_dim, dropout, attention_dropout,
                                                 norm_layer))
            for i in range(num_layers)))
        self.ln = norm_layer(hidden_dim)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.ln(self.layers(self.dropout(inputs + self.pos_embedding)))


#: torchvision's default norm layer (a module-level value, so the default argument is not a call).
_LAYER_NORM = partial(nn.LayerNorm, eps=1e-6)


class VisionTransformer(nn.Module):
    """Stand-in for `torchvision.models.VisionTransformer` (ViT, arXiv:2010.11929); same arguments."""

    def __init__(self, image_size: int, patch_size: int, num_layers: int, num_heads: int, hidden_dim: int,
                 mlp_dim: int, dropout: float = 0.0, attention_dropout: float = 0.0, num_classes: int = 1000,
                 representation_size: int | None = None,
                 norm_layer: Callable[..., nn.Module] = _LAYER_NORM,
                 conv_stem_configs: Sequence[Any] | None = None) -> None:
        super().__init__()
        if image_size % patch_size:
            raise ValueError("Input shape indivisible by patch size!")
        if conv_stem_configs is not None:
            raise NotImplementedError("conv_stem_configs needs torchvision; the fallback has the patchify stem only")
        self.image_size, self.patch_size, self.hidden_dim = image_size, patch_size, hidden_dim
        self.mlp_dim, self.num_classes, self.representation_size = mlp_dim, num_classes, representation_size
        self.dropout, self.attention_dropout, self.norm_layer = dropout, attention_dropout, norm_layer
        self.conv_proj = nn.Conv2d(3, hidden_dim, kernel_size=patch_size, stride=patch_size)
        self.class_token = nn.Parameter(torch.zeros(1, 1, hidden_dim))
        self.seq_length = (image_size // patch_size) ** 2 + 1
        self.encoder = _Encoder(self.seq_length, num_layers, num_heads, hidden_dim, mlp_dim, dropout,
                                attention_dropout, norm_layer)
        heads: OrderedDict[str, nn.Module] = OrderedDict()
        if representation_size is None:
            heads["head"] = nn.Linear(hidden_dim, num_classes)
        else:
            heads["pre_logits"] = nn.Linear(hidden_dim, representation_size)
            heads["act"] = nn.Tanh()
            heads["head"] = nn.Linear(representation_size, num_classes)
        self.heads = nn.Sequential(heads)
        fan_in = 3 * patch_size * patch_size
        nn.init.trunc_normal_(self.conv_proj.weight, std=math.sqrt(1 / fan_in))
        nn.init.zeros_(self.conv_proj.bias)
        if representation_size is not None:
            nn.init.trunc_normal_(self.heads.pre_logits.weight, std=math.sqrt(1 / hidden_dim))
            nn.init.zeros_(self.heads.pre_logits.bias)
        nn.init.zeros_(self.heads.head.weight)
        nn.init.zeros_(self.heads.head.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, _, h, w = x.shape
        if h != self.image_size or w != self.image_size:
            raise ValueError(f"Wrong image size! Expected {self.image_size} but got {h}x{w}!")
        x = self.conv_proj(x).reshape(n, self.hidden_dim, -1).permute(0, 2, 1)  # (n, patches, hidden)
        x = torch.cat([self.class_token.expand(n, -1, -1), x], dim=1)
        return self.heads(self.encoder(x)[:, 0])


# -- transforms -----------------------------------------------------------------------------------------


class Compose:
    def __init__(self, transforms: Sequence[Callable[[Any], Any]]) -> None:
        self.transforms = list(transforms)

    def __call__(self, value: Any) -> Any:
        for transform in self.transforms:
            value = transform(value)
        return value


class ToTensor:
    """HWC uint8 image (numpy array, or anything np.asarray takes) → CHW float tensor in [0, 1]."""

    def __call__(self, picture: Any) -> torch.Tensor:
        array = np.asarray(picture)
        if array.ndim == 2:
            array = array[:, :, None]
        tensor = torch.from_numpy(np.ascontiguousarray(array.transpose(2, 0, 1)))
        return tensor.float().div(255) if tensor.dtype == torch.uint8 else tensor.float()


class Normalize:
    def __init__(self, mean: Sequence[float], std: Sequence[float], inplace: bool = False) -> None:
        self.mean, self.std, self.inplace = list(mean), list(std), inplace

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        mean = torch.as_tensor(self.mean, dtype=tensor.dtype).view(-1, 1, 1)
        std = torch.as_tensor(self.std, dtype=tensor.dtype).view(-1, 1, 1)
        return tensor.sub_(mean).div_(std) if self.inplace else (tensor - mean) / std


class transforms:  # noqa: N801 - used as `transforms.Compose(...)`, like the torchvision module
    Compose = Compose
    ToTensor = ToTensor
    Normalize = Normalize


# -- datasets -------------------------------------------------------------------------------------------


class CIFAR10(torch.utils.data.Dataset):
    """Stand-in for `torchvision.datasets.CIFAR10`: the python-pickle batches under root."""

    base_folder = "cifar-10-batches-py"
    train_list = [f"data_batch_{i}" for i in range(1, 6)]
    test_list = ["test_batch"]

    def __init__(self, root: str, train: bool = True, transform: Callable[[Any], Any] | None = None,
                 target_transform: Callable[[Any], Any] | None = None, download: bool = False) -> None:
        self.root = os.path.expanduser(str(root))
        self.train, self.transform, self.target_transform = train, transform, target_transform
        folder = os.path.join(self.root, self.base_folder)
        names = self.train_list if train else self.test_list
        missing = [n for n in names + ["batches.meta"] if not os.path.exists(os.path.join(folder, n))]
        if missing:
            raise RuntimeError(
                f"Dataset not found at {folder} (missing {', '.join(missing)}). torchvision is not importable "
                + ("here, and this fallback reader cannot download CIFAR-10. " if download else "here. ")
                + "Install a torchvision that matches your torch, or generate a CIFAR-shaped data set with "
                "`python make_fake_cifar.py --root DIR` and set CIFAR10_ROOT=DIR CIFAR10_DOWNLOAD=0.")
        data, targets = [], []
        for name in names:
            with open(os.path.join(folder, name), "rb") as fh:
                entry = pickle.load(fh, encoding="latin1")
            data.append(entry["data"])
            targets.extend(entry["labels"] if "labels" in entry else entry["fine_labels"])
        self.data = np.vstack(data).reshape(-1, 3, 32, 32).transpose((0, 2, 3, 1))  # HWC, as torchvision
        self.targets = targets
        with open(os.path.join(folder, "batches.meta"), "rb") as fh:
            self.classes = pickle.load(fh, encoding="latin1")["label_names"]
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        image, target = self.data[index], self.targets[index]
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target


class datasets:  # noqa: N801 - used as `datasets.CIFAR10(...)`, like the torchvision module
    CIFAR10 = CIFAR10


__all__ = ["CIFAR10", "Compose", "Normalize", "ToTensor", "VisionTransformer", "datasets", "transforms"]
