"""Tracking pieces that need no store: URIs, parameter cleaning, links, lazy imports, and failure
paths against an unreachable server (tracking must warn, return quickly and never raise)."""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from air.errors import UserInputError
from air.server.mlflow_server import ui_argv
from air.tracking import (
    SystemMetricsSampler,
    TrackingHandle,
    embedded_uri,
    flatten_params,
    run_url,
    start_attempt_run,
    start_call_run,
    tracking_uri,
    ui_base_url,
)
from air.tracking.params import MAX_PARAM_VALUE_LENGTH, clean_key, clean_params


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_import_does_not_import_mlflow() -> None:
    code = "import sys, air.tracking; sys.exit('mlflow' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_tracking_uri_embedded_default_and_env_override(
    air_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert tracking_uri() == embedded_uri() == f"sqlite:///{air_home / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.internal:5000")
    assert tracking_uri() == "http://mlflow.internal:5000"
    assert ui_base_url() == "http://mlflow.internal:5000"
    with pytest.raises(UserInputError, match="serves its own UI"):
        ui_argv("127.0.0.1", 5000)


def test_flatten_params_nests_with_dots() -> None:
    params = {
        "lr": 0.1,
        "model": {"depth": 12, "heads": {"n": 8}},
        "sizes": [1, 2],
        "empty": {},
        "none": None,
    }
    assert flatten_params(params) == {
        "lr": "0.1",
        "model.depth": "12",
        "model.heads.n": "8",
        "sizes": "[1, 2]",
        "empty": "{}",
        "none": "None",
    }


def test_params_are_made_acceptable_to_mlflow() -> None:
    warnings: list[str] = []
    cleaned = clean_params({"bad key!": "x" * 7000, "k" * 300: 1, "a/../b": 2, "ok": 3}, warnings.append)
    assert len(cleaned["bad key_"]) == MAX_PARAM_VALUE_LENGTH
    assert cleaned["ok"] == "3"
    assert "a_.._b" in cleaned
    assert len(cleaned) == 3
    assert len(warnings) == 2  # one for cut values, one for dropped keys
    assert clean_key("/abs") == "_abs" and clean_key("") == "_"


def test_run_url_points_into_the_ui() -> None:
    assert run_url("abc", "7") == "http://127.0.0.1:5000/#/experiments/7/runs/abc"
    handle = TrackingHandle("abc", "7", "http://mlflow.internal:5000/")
    assert handle.url() == "http://mlflow.internal:5000/#/experiments/7/runs/abc"
    assert (
        TrackingHandle("abc", "7", "sqlite:////x/mlflow.db").url("http://h:1")
        == "http://h:1/#/experiments/7/runs/abc"
    )


def test_tracking_ref_round_trips_into_a_link(tmp_path: Path) -> None:
    """`tracking.json` is written whole (no temp file left) and read back into the same links as before."""
    from air.tracking.handle import write_tracking_ref
    from air.tracking.ui import tracking_ref_url

    ref = tmp_path / "attempt_0" / "tracking.json"
    assert tracking_ref_url(ref) is None  # no note yet: no link, no error
    write_tracking_ref(ref, TrackingHandle("abc", "7", "http://mlflow.internal:5000/"))
    assert [p.name for p in ref.parent.iterdir()] == ["tracking.json"]
    assert tracking_ref_url(ref) == "http://mlflow.internal:5000/#/experiments/7/runs/abc"
    write_tracking_ref(ref, TrackingHandle("abc", "7", "sqlite:////nowhere/mlflow.db"))
    assert tracking_ref_url(ref) == "http://127.0.0.1:5000/#/experiments/7/runs/abc"
    ref.write_text("{not json")
    assert tracking_ref_url(ref) is None


def test_handle_pickles_without_the_callers_warn() -> None:
    handle = TrackingHandle("abc", "7", "sqlite:////x/mlflow.db", warn=lambda m: None)
    again = pickle.loads(pickle.dumps(handle))
    assert again == handle


def test_unreachable_server_warns_returns_none_quickly_and_raises_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import mlflow

    uri = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    warnings: list[str] = []
    started = time.monotonic()
    assert start_attempt_run("exp", "run", {"air.run_id": "r"}, {"lr": 1}, warn=warnings.append) is None
    assert start_call_run("train", {}, warn=warnings.append) is None
    handle = TrackingHandle("0" * 32, "1", uri, warnings.append)
    assert handle.end("FAILED") is False
    assert handle.log_node_log(__file__, attempt=0, node=0) is False
    sampler = SystemMetricsSampler("0" * 32, node_rank=0, interval_s=0.05, warn=warnings.append)
    sampler.start()
    sampler.stop()
    elapsed = time.monotonic() - started
    assert elapsed < 15, elapsed
    assert len(warnings) >= 5, warnings
    assert all(w.startswith("tracking: ") for w in warnings)
    assert uri in warnings[0] and "without MLflow tracking" in warnings[0]
    assert any("system metrics of node 0 stopped" in w for w in warnings)
    assert mlflow.active_run() is None
    assert not [k for k in os.environ if k.startswith("MLFLOW_HTTP_REQUEST")]  # limits were scoped


def test_bad_uri_is_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuchscheme://x")
    warnings: list[str] = []
    assert start_attempt_run("exp", None, {}, {}, warn=warnings.append) is None
    assert len(warnings) == 1 and "nosuchscheme://x" in warnings[0]


@pytest.mark.gpu
def test_sampler_logs_gpu_metrics_through_nvml() -> None:
    """On the lent GPU machine: NVML readings land as system/node_<n>/gpu_<i>_... metrics."""
    import pynvml

    pynvml.nvmlInit()  # deselected off GPU machines (-m "not gpu"); here a missing driver is a failure
    from mlflow import MlflowClient

    handle = start_attempt_run("gpu-metrics", None, {}, {})
    assert handle is not None
    with SystemMetricsSampler(handle.run_id, node_rank=1, interval_s=0.1, gpu_indices=[0]):
        pass
    metrics = MlflowClient(tracking_uri()).get_run(handle.run_id).data.metrics
    assert "system/node_1/gpu_0_utilization_percentage" in metrics
    assert "system/node_1/gpu_0_memory_usage_megabytes" in metrics


def test_creating_the_embedded_store_prints_nothing(tmp_path: Path) -> None:
    """A first remote=True call creates the store in the user's process: MLflow's INFO lines are noise."""
    home = tmp_path / "fresh-home"
    code = "from air.tracking.store import embedded_uri, prepare_store; prepare_store(embedded_uri())"
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "AIR_HOME": str(home)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (home / "mlflow.db").exists()
    assert "Creating initial MLflow database tables" not in done.stderr, done.stderr
    assert done.stderr == "", done.stderr
