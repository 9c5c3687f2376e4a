"""Ray integration: `ray_launch` (a Ray cluster per call), `RayMetricsMonitor`, and the helpers that
start air-owned Ray nodes (`air.backends.ray_cluster`). Importing this package does not import Ray."""

from __future__ import annotations

from typing import Any

__all__ = ["RayMetricsMonitor", "ray_launch"]


def __getattr__(name: str) -> Any:
    if name == "ray_launch":
        from air.ray.launch import ray_launch

        return ray_launch
    if name == "RayMetricsMonitor":
        from air.ray.metrics import RayMetricsMonitor

        return RayMetricsMonitor
    raise AttributeError(f"module 'air.ray' has no attribute {name!r}")
