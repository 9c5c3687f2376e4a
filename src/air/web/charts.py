"""Server-rendered SVG line charts for the run page: axes, ticks, units, a time scale and hover values.

No JavaScript and no chart library (nothing to build, nothing fetched: the pages work offline and under
their Content-Security-Policy). `line_chart` turns a metric history into plain numbers and labels; the
template (run.html) draws them as SVG, each point with a `<title>` the browser shows on hover.
A training metric is drawn over its steps, with the time elapsed since the first point under each step
tick; a system metric (sampled every few seconds, its "step" is only a counter) is drawn over time.
"""

from __future__ import annotations

import datetime as _dt
import math
from collections.abc import Sequence

#: A metric name's suffix -> the unit its axis shows (the names system metrics are logged under).
UNITS = (("_percentage", "%"), ("_megabytes", "MB"), ("_watts", "W"), ("_seconds", "s"), ("_bytes", "B"))
#: The plot's margins inside the SVG: room for the y tick labels (left) and two rows of x labels (bottom).
LEFT, RIGHT, TOP, BOTTOM = 52, 14, 10, 38


def unit_of(name: str) -> str:
    """The unit a metric's name says it is in ("" for a training metric, whose unit only its author knows)."""
    return next((unit for suffix, unit in UNITS if name.endswith(suffix)), "")


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """About `count` round values (1, 2 or 5 × 10^k apart) covering [low, high]."""
    if not (math.isfinite(low) and math.isfinite(high)):
        return []
    if high <= low:
        return [low]
    raw = (high - low) / max(count - 1, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    first = math.ceil(low / step - 1e-9) * step
    ticks = []
    value = first
    while value <= high + step * 1e-9:
        ticks.append(0.0 if abs(value) < step * 1e-9 else value)
        value += step
    return ticks


def number_text(value: float) -> str:
    """A tick or hover value, short: 0.25, 1.2k, 3.5M, 1e-05."""
    magnitude = abs(value)
    if magnitude and (magnitude >= 1e6 or magnitude < 1e-3):
        return f"{value:.3g}" if magnitude < 1e6 else f"{value / 1e6:.3g}M"
    if magnitude >= 1e4:
        return f"{value / 1e3:.3g}k"
    return f"{value:.4g}"


def tick_text(value: float, ticks: Sequence[float]) -> str:
    """A tick's label with as many digits as the ticks' spacing needs, so neighbouring ticks never read the
    same (0.01995 and 0.01996, not 0.02 twice)."""
    label = number_text(value)
    if len(ticks) < 2 or len({number_text(t) for t in ticks}) == len(ticks):
        return label
    spacing = min(abs(b - a) for a, b in zip(ticks, ticks[1:], strict=False) if b != a)
    decimals = max(0, -math.floor(math.log10(spacing))) + 1
    return f"{value:.{decimals}f}".rstrip("0").rstrip(".") or "0"


def elapsed_text(seconds: float) -> str:
    """Time since the chart's first point: 0s, 45s, 3m05s, 1h02m."""
    seconds = max(seconds, 0.0)
    if seconds < 60:
        return f"{seconds:.0f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def clock_text(epoch_s: float) -> str:
    """A point's wall-clock time with its zone, as the hover shows it (the server's local zone)."""
    return _dt.datetime.fromtimestamp(epoch_s).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")


def line_chart(
    points: Sequence[tuple[float, ...]], name: str = "", *, over_time: bool = False,
    width: int = 380, height: int = 190,
) -> dict[str, object]:
    """The chart of `points` ((step, value) or (step, value, epoch seconds)) in a width x height SVG.

    Over steps, or over the time since the first point with `over_time` (points without times fall back to
    steps). Returns the polyline, each point's position and hover text, the axes, their ticks and labels.
    """
    unit = unit_of(name)
    empty: dict[str, object] = {"points": "", "dots": [], "x_ticks": [], "y_ticks": [], "min": None, "max": None, "last": None,
             "width": width, "height": height, "unit": unit, "x_label": "", "span": ""}
    rows = [(float(p[0]), float(p[1]), float(p[2]) if len(p) > 2 else None) for p in points]
    rows = [r for r in rows if math.isfinite(r[1])]
    if not rows:
        return empty
    timed = all(r[2] is not None for r in rows)
    t0 = min((r[2] for r in rows if r[2] is not None), default=0.0)
    by_time = over_time and timed
    xs = [(r[2] or 0.0) - t0 if by_time else r[0] for r in rows]
    ys = [r[1] for r in rows]
    x_ticks_at = nice_ticks(min(xs), max(xs), 5) if not by_time else _time_ticks(max(xs))
    y_ticks_at = nice_ticks(min(ys), max(ys), 5)
    x0, x1 = min([*xs, *x_ticks_at]), max([*xs, *x_ticks_at])
    y0, y1 = min([*ys, *y_ticks_at]), max([*ys, *y_ticks_at])
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
        y0, y1 = y0 - (abs(y0) or 1) * 0.1, y1 + (abs(y1) or 1) * 0.1
    plot_w, plot_h = width - LEFT - RIGHT, height - TOP - BOTTOM

    def px(x: float) -> float:
        return LEFT + (x - x0) / (x1 - x0) * plot_w

    def py(y: float) -> float:
        return TOP + plot_h - (y - y0) / (y1 - y0) * plot_h

    suffix = f" {unit}" if unit else ""
    dots = []
    for (step, value, at), x in zip(rows, xs, strict=True):
        title = f"step {step:g}: {number_text(value)}{suffix}"
        if at is not None:
            title += f" at {clock_text(at)} (+{elapsed_text(at - t0)})"
        dots.append({"x": round(px(x), 1), "y": round(py(value), 1), "title": title})
    x_ticks = []
    for tick in x_ticks_at:
        if by_time:
            label, sub = elapsed_text(tick), ""
        else:
            label = number_text(tick)
            sub = "+" + elapsed_text(_time_at_step(rows, tick) - t0) if timed else ""
        x_ticks.append({"x": round(px(tick), 1), "label": label, "sub": sub})
    y_ticks = [{"y": round(py(tick), 1), "label": tick_text(tick, y_ticks_at)} for tick in y_ticks_at]
    span = ""
    if timed:
        span = f"{clock_text(t0)} – {clock_text(max(r[2] or t0 for r in rows))}"
    return {
        "points": " ".join(f"{d['x']},{d['y']}" for d in dots), "dots": dots, "x_ticks": x_ticks,
        "y_ticks": y_ticks, "min": min(ys), "max": max(ys), "last": ys[-1], "width": width, "height": height,
        "unit": unit, "x_label": "time since first point" if by_time else "step", "span": span,
        "left": LEFT, "right": width - RIGHT, "top": TOP, "bottom": height - BOTTOM,
    }


def _time_ticks(longest: float) -> list[float]:
    """Round elapsed times (seconds, minutes or hours apart) from 0 to `longest` seconds."""
    for unit in (1, 60, 3600):
        if longest / unit < 120 or unit == 3600:
            return [t * unit for t in nice_ticks(0.0, max(longest / unit, 1e-9), 5)]
    return [0.0]


def _time_at_step(rows: Sequence[tuple[float, float, float | None]], step: float) -> float:
    """The time of the point nearest to `step` (tick labels under a step axis say when it was reached)."""
    nearest = min(rows, key=lambda r: abs(r[0] - step))
    return nearest[2] or 0.0

