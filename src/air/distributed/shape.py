"""Turning `@distributed(...)` arguments into a validated shape: how many ranks, of which type.

Both spellings are accepted: `gpus=`/`gpu_type=` (the original API) and `num_accelerators=`/
`accelerator_type=` (the newer one), never both at once. Locally the shape is checked against what
this machine has, and every error says what it has and how to run on CPU instead.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from air.accelerators import (
    AcceleratorType,
    MachineAccelerators,
    cpu_slots,
    cpu_type,
    discover,
    normalize_model,
    parse_accelerator_type,
)
from air.errors import GPUTypeError, GPUValidationError, RuntimeConfigurationError

UNSET = object()


@dataclass(frozen=True)
class CallSettings:
    """Validated decorator settings; `accelerator_type` is the user's spelling, resolved later."""

    num_accelerators: int | None
    accelerator_type: str | None
    remote: bool
    timeout: float | None
    #: Seconds a rank may go without progress before the call is ended with a HangError (None: off).
    hang_timeout: float | None = None


@dataclass(frozen=True)
class LocalShape:
    """What a local call will start: `world_size` ranks of `accelerator`, on these GPU ids (or none)."""

    accelerator: AcceleratorType
    world_size: int
    gpu_ids: tuple[str, ...]


def check_settings(num_accelerators: object = None, accelerator_type: object = None, remote: object = False,
                   timeout: object = UNSET, gpus: object = None, gpu_type: object = None,
                   default_timeout: float | None = None, *, hang_timeout: object = None) -> CallSettings:
    """Validate types and the two spellings; knows nothing about the machine yet."""
    if gpus is not None and num_accelerators is not None:
        raise RuntimeConfigurationError(
            "Pass either gpus= or num_accelerators=, not both (gpus= is the older name of num_accelerators=).")
    if gpu_type is not None and accelerator_type is not None:
        raise RuntimeConfigurationError(
            "Pass either gpu_type= or accelerator_type=, not both (gpu_type= is the older name of accelerator_type=).")
    count = num_accelerators if num_accelerators is not None else gpus
    kind = accelerator_type if accelerator_type is not None else gpu_type
    name = "num_accelerators" if num_accelerators is not None else "gpus"
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count <= 0):
        raise RuntimeConfigurationError(f"{name} must be a positive integer, got {count!r}.")
    if kind is not None and not isinstance(kind, str):
        raise RuntimeConfigurationError(f"accelerator_type must be a string such as 'H100' or 'CPU', got {kind!r}.")
    if not isinstance(remote, bool):
        raise RuntimeConfigurationError(f"remote must be True or False, got {remote!r}.")
    if timeout is UNSET:
        timeout = default_timeout
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not math.isfinite(timeout) or timeout <= 0):
        raise RuntimeConfigurationError(f"timeout must be a positive number of seconds or None, got {timeout!r}.")
    if hang_timeout is not None and (isinstance(hang_timeout, bool) or not isinstance(hang_timeout, (int, float))
                                     or not math.isfinite(hang_timeout) or hang_timeout <= 0):
        raise RuntimeConfigurationError(
            f"hang_timeout must be a positive number of seconds or None, got {hang_timeout!r}.")
    return CallSettings(count, kind, remote, None if timeout is None else float(timeout),
                        None if hang_timeout is None else float(hang_timeout))


def parse_requested_type(value: str) -> AcceleratorType | str:
    """A canonical type (`GPU_8xH100`, `CPU_2xCPU`, case-insensitive here), a bare model (`H100`, `cpu`),
    or 'GPU' for whatever GPUs this machine has ("" as the model)."""
    text = value.strip()
    if text.lower() == "cpu":
        return cpu_type(1)
    if text.lower() == "gpu":
        return ""  # any GPU model: whatever this machine has
    if "_" in text and "x" in text.lower():
        kind, _, rest = text.partition("_")
        per_node, sep, model = rest.lower().partition("x")
        if sep:
            canonical_model = "CPU" if kind.upper() == "CPU" else (normalize_model(model) or model.upper())
            return parse_accelerator_type(f"{kind.upper()}_{per_node}x{canonical_model}")
    known = normalize_model(text)
    if known is None:
        raise GPUTypeError(
            f"Unknown accelerator type {value!r}.",
            hint="Use a GPU model such as 'H100' or 'A10', a node shape such as 'GPU_8xH100', 'GPU' for this "
            "machine's GPUs, or 'CPU' to run on CPU processes with gloo.",
        )
    return known


def _cpu_hint() -> str:
    return "To run the same function on CPU (gloo instead of NCCL), pass accelerator_type='CPU'."


def resolve_local(settings: CallSettings, machine: MachineAccelerators | None = None) -> LocalShape:
    """Check the request against this machine; pick the GPUs (or CPU slots) the ranks will use."""
    requested = parse_requested_type(settings.accelerator_type) if settings.accelerator_type else None
    if isinstance(requested, AcceleratorType) and requested.is_cpu:
        slots = machine.cpu_slots if machine else cpu_slots()  # no GPU query: it costs ~25 ms (NVML) or more
        count = settings.num_accelerators or slots
        if count > slots:
            raise GPUValidationError(
                f"Asked for {count} CPU processes but this machine has {slots} CPU slots.",
                hint=f"Use num_accelerators <= {slots}, or set AIR_CPU_SLOTS={count} to allow "
                "more processes than cores (fine for tests, slow for training).",
            )
        return LocalShape(cpu_type(count), count, ())
    machine = machine or discover()
    model = (requested.model if isinstance(requested, AcceleratorType) else requested) or None
    if not machine.gpus:
        what = f"{settings.num_accelerators or 'all'} {model or ''} GPU".replace("  ", " ")
        raise GPUValidationError(
            f"Asked for {what}(s) but this machine has no GPU"
            + (f" visible (CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r})."
               if "CUDA_VISIBLE_DEVICES" in os.environ else "."),
            hint=_cpu_hint() + " Or use remote=True with a Ray profile that has GPUs.",
        )
    if model is not None and model != machine.gpu_model:
        raise GPUTypeError(
            f"Asked for {model} GPUs but this machine has {machine.describe()}.",
            hint=f"Pass accelerator_type='{machine.gpu_model}' (or leave it out) to use them, remote=True to run "
            f"elsewhere, or accelerator_type='CPU'.",
        )
    count = settings.num_accelerators or len(machine.gpus)
    if count > len(machine.gpus):
        raise GPUValidationError(
            f"Asked for {count} GPUs but this machine has {machine.describe()}.",
            hint=f"Use num_accelerators <= {len(machine.gpus)}, remote=True to run on more nodes, or "
            "accelerator_type='CPU' to try it on CPU.",
        )
    gpu_ids = tuple(g.physical_id for g in machine.gpus[:count])
    return LocalShape(AcceleratorType("GPU", count, machine.gpu_model or "GPU"), count, gpu_ids)


def required_shape(settings: CallSettings) -> tuple[int, str]:
    """A remote call's rank count and accelerator type, both of which it must name (no machine to default to)."""
    count = settings.num_accelerators
    raw = (settings.accelerator_type or "").strip()
    if count is None or not raw:
        missing = " and ".join(n for n, v in (("num_accelerators", count), ("accelerator_type", raw)) if not v)
        raise RuntimeConfigurationError(
            f"remote=True needs {missing}: how many ranks, on which accelerator.",
            hint="For example @distributed(num_accelerators=16, accelerator_type='GPU_8xH100', remote=True), "
            "or accelerator_type='CPU' to run CPU ranks.",
        )
    return count, raw
