"""Read back an attempt's metric histories from its MLflow run, for the small charts of the run page.

Training metrics (what the user's code logs) and per-node system metrics (`system/node_<n>/…`, logged by
`sysmetrics.py`) come from the same store; a store that cannot be read gives no charts, never an error.
"""

from __future__ import annotations

from air.tracking.store import client, tracking_uri

#: Points kept per chart: enough for a curve, small enough for an inline SVG.
MAX_POINTS = 200
#: Charts read per run page (a run logging thousands of metric keys shows the first ones).
MAX_METRICS = 24


def metric_histories(
    mlflow_run_id: str, *, uri: str | None = None, max_points: int = MAX_POINTS
) -> dict[str, list[tuple[float, float, float]]]:
    """Metric key -> [(step, value, epoch seconds)] of one MLflow run, thinned to `max_points` (the time
    gives the run page's charts their time scale); {} when unreadable."""
    try:
        mlflow_client = client(uri or tracking_uri())
        keys = sorted(mlflow_client.get_run(mlflow_run_id).data.metrics)[:MAX_METRICS]
        out: dict[str, list[tuple[float, float, float]]] = {}
        for key in keys:
            points = sorted((m.step, m.timestamp, m.value) for m in mlflow_client.get_metric_history(
                mlflow_run_id, key))
            stride = max(1, -(-len(points) // max_points))
            out[key] = [(float(step), float(value), at / 1000.0) for step, at, value in points[::stride]]
        return out
    except Exception:  # no store, a deleted run: the page shows no charts
        return {}

