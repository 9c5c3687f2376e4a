"""Compatibility path: `from serverless_gpu.ray import ray_launch, RayMetricsMonitor` (thin re-exports)."""

from air.ray.launch import ray_launch
from air.ray.metrics import RayMetricsMonitor

__all__ = ["RayMetricsMonitor", "ray_launch"]
