"""Small inline-SVG line charts (no JavaScript, no chart library): one polyline per metric history."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def line_chart(points: Sequence[tuple[float, float]], width: int = 260, height: int = 64) -> dict[str, Any]:
    """The polyline of `points` (step, value) scaled into width x height, with its range and last value."""
    if not points:
        return {"points": "", "min": None, "max": None, "last": None, "width": width, "height": height}
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    dx, dy = (x1 - x0) or 1.0, (y1 - y0) or 1.0
    pad = 3
    coords = " ".join(
        f"{pad + (x - x0) / dx * (width - 2 * pad):.1f},{height - pad - (y - y0) / dy * (height - 2 * pad):.1f}"
        for x, y in points
    )
    return {"points": coords, "min": y0, "max": y1, "last": ys[-1], "width": width, "height": height}


__all__ = ["line_chart"]
