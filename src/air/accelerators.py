"""Accelerator types (`GPU_8xH100`, `CPU_4xCPU`) and what this machine has.

Types follow `<KIND>_<per node>x<MODEL>`. GPU models come from the device name (NVML, else
nvidia-smi), honouring CUDA_VISIBLE_DEVICES. The CPU kind runs the same code with gloo, so every
workload and decorator call can be tried on a laptop or in CI.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from dataclasses import dataclass

from air.errors import GPUTypeError, GPUValidationError
from air.settings import AIR_CPU_SLOTS, AIR_FAKE_GPUS

_TYPE_RE = re.compile(r"^(GPU|CPU)_([1-9][0-9]*)x([A-Za-z0-9]+)$")

#: Device-name fragments → model, most specific first ("NVIDIA H100 80GB HBM3" → H100).
_MODEL_PATTERNS: tuple[tuple[str, str], ...] = (
    ("GB200", "GB200"), ("B300", "B300"), ("B200", "B200"), ("H200", "H200"), ("H100", "H100"),
    ("H800", "H800"), ("A100", "A100"), ("A800", "A800"), ("A10G", "A10"), ("A10", "A10"),
    ("L40S", "L40S"), ("L40", "L40"), ("L4", "L4"), ("A6000", "A6000"), ("T4", "T4"), ("V100", "V100"),
)

#: Legacy `gpu_type=` spellings of the hosted product → model.
_LEGACY_MODELS = {"a10": "A10", "a10g": "A10", "h100": "H100", "h100_80gb": "H100", "b300": "B300"}

CPU_MODEL = "CPU"


@dataclass(frozen=True)
class AcceleratorType:
    """A node shape: `kind` GPU or CPU, `per_node` devices per node, `model` (H100, A10, CPU…)."""

    kind: str
    per_node: int
    model: str

    @property
    def name(self) -> str:
        return f"{self.kind}_{self.per_node}x{self.model}"

    @property
    def is_cpu(self) -> bool:
        return self.kind == "CPU"

    def nodes_for(self, num_accelerators: int) -> int:
        """Nodes needed for `num_accelerators`; a count that is not a multiple of per_node is an error."""
        if num_accelerators <= 0:
            raise GPUValidationError(f"num_accelerators must be a positive integer, got {num_accelerators}.")
        if num_accelerators % self.per_node:
            multiples = ", ".join(str(self.per_node * k) for k in (1, 2, 3))
            raise GPUValidationError(
                f"num_accelerators={num_accelerators} is not a multiple of {self.per_node}, the devices per "
                f"node of {self.name}.",
                hint=f"Use {multiples}, … (nodes = num_accelerators / {self.per_node}).",
            )
        return num_accelerators // self.per_node

    def __str__(self) -> str:
        return self.name


def parse_accelerator_type(value: str) -> AcceleratorType:
    """Parse a canonical type name (case-sensitive, as the workload YAML demands)."""
    match = _TYPE_RE.match(value.strip()) if isinstance(value, str) else None
    if not match:
        raise GPUTypeError(
            f"Unknown accelerator type {value!r}.",
            hint="Accelerator types look like GPU_1xA10, GPU_1xH100, GPU_8xH100 or, without a GPU, "
            "CPU_2xCPU (2 CPU processes per node, gloo instead of NCCL).",
        )
    kind, per_node, model = match.group(1), int(match.group(2)), match.group(3)
    if kind == "CPU" and model != CPU_MODEL:
        raise GPUTypeError(f"Unknown accelerator type {value!r}.", hint=f"The CPU kind is written CPU_{per_node}xCPU.")
    if kind == "GPU" and model == CPU_MODEL:
        raise GPUTypeError(f"Unknown accelerator type {value!r}.", hint=f"Did you mean CPU_{per_node}xCPU?")
    return AcceleratorType(kind, per_node, model)


def normalize_model(name: str) -> str | None:
    """Map a GPU device name or a legacy spelling to its model, or None when it names no known GPU."""
    lowered = name.strip().lower()
    if lowered in _LEGACY_MODELS:
        return _LEGACY_MODELS[lowered]
    upper = name.upper()
    for fragment, model in _MODEL_PATTERNS:
        if fragment in upper:
            return model
    return None


@dataclass(frozen=True)
class GpuDevice:
    """One visible GPU: its index as the ranks will see it, its physical index or UUID, and its name."""

    visible_index: int
    physical_id: str
    name: str

    @property
    def model(self) -> str:
        return normalize_model(self.name) or re.sub(r"[^A-Za-z0-9]", "", self.name.replace("NVIDIA", ""))


@dataclass(frozen=True)
class MachineAccelerators:
    """What this machine can run: its visible GPUs and its CPU slots."""

    gpus: tuple[GpuDevice, ...]
    cpu_slots: int

    @property
    def gpu_model(self) -> str | None:
        return self.gpus[0].model if self.gpus else None

    def describe(self) -> str:
        if not self.gpus:
            return f"no GPU and {self.cpu_slots} CPU slots"
        return f"{len(self.gpus)} × {self.gpu_model} GPU and {self.cpu_slots} CPU slots"


def cpu_slots() -> int:
    """CPU slots of this machine: AIR_CPU_SLOTS, else the CPU count."""
    configured = os.environ.get(AIR_CPU_SLOTS)
    if configured:
        try:
            value = int(configured)
        except ValueError as exc:
            raise GPUValidationError(f"AIR_CPU_SLOTS must be a positive integer, got {configured!r}.") from exc
        if value > 0:
            return value
    return os.cpu_count() or 1


def _visible_filter(all_gpus: list[tuple[int, str, str]]) -> list[tuple[int, str, str]]:
    """Apply CUDA_VISIBLE_DEVICES (indices or UUIDs, as CUDA reads it) to (index, uuid, name) rows."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return all_gpus
    chosen: list[tuple[int, str, str]] = []
    for token in (t.strip() for t in visible.split(",")):
        if not token:
            break
        match = next(
            (g for g in all_gpus if (token.isdigit() and g[0] == int(token)) or g[1].startswith(token)), None
        )
        if match is None:  # CUDA stops at the first invalid entry
            break
        chosen.append(match)
    return chosen


def _query_nvml() -> list[tuple[int, str, str]] | None:
    try:
        import pynvml  # from nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        rows = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            rows.append((index, uuid if isinstance(uuid, str) else uuid.decode(),
                         name if isinstance(name, str) else name.decode()))
        return rows
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _query_nvidia_smi() -> list[tuple[int, str, str]] | None:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=index,uuid,name", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    rows = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 3 and parts[0].isdigit():
            rows.append((int(parts[0]), parts[1], ",".join(parts[2:])))
    return rows


@functools.lru_cache(maxsize=8)
def _discover(visible_key: str | None, cpu_key: str | None) -> MachineAccelerators:
    rows = _query_nvml()
    if rows is None:
        rows = _query_nvidia_smi() or []
    visible = _visible_filter(rows)
    gpus = tuple(GpuDevice(i, str(idx) if visible_key is None or uuid_or_idx_is_index(visible_key) else uuid, name)
                 for i, (idx, uuid, name) in enumerate(visible))
    return MachineAccelerators(gpus=gpus, cpu_slots=cpu_slots())


def uuid_or_idx_is_index(visible_key: str) -> bool:
    return all(t.strip().isdigit() for t in visible_key.split(",") if t.strip())


def discover() -> MachineAccelerators:
    """This machine's visible GPUs and CPU slots (cached per CUDA_VISIBLE_DEVICES / AIR_CPU_SLOTS)."""
    if os.environ.get(AIR_FAKE_GPUS):
        # "N:MODEL" for tests of validation messages and slot ledgers on machines without GPUs; the ranks
        # get CUDA_VISIBLE_DEVICES but nothing checks that a device exists.
        count, _, model = os.environ[AIR_FAKE_GPUS].partition(":")
        gpus = tuple(GpuDevice(i, str(i), f"NVIDIA {model or 'H100'}") for i in range(int(count)))
        return MachineAccelerators(gpus=gpus, cpu_slots=cpu_slots())
    return _discover(os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get(AIR_CPU_SLOTS))


def cpu_type(per_node: int) -> AcceleratorType:
    return AcceleratorType("CPU", per_node, CPU_MODEL)
