"""`@ray_launch` without an active MLflow run (issue 24): the call's MLflow run is made lazily (no
caller run, mlflow not imported by the caller, MLFLOW_RUN_ID not set), and Ray Train's reports and Ray's
system metrics still reach it although the function never imports mlflow.

The lazy run is made by the caller when a rank first asks for it; the head asks as it starts, so the run
usually exists before the Ray head is up, but not always: on a loaded machine the caller's `import mlflow`
and a fresh store's schema take longer than the head's start, and the driver then decided on Ray Train's
report callback before the run existed (no `loss` in MLflow, the flake this test once had). The second
test holds that case still: no run exists until the driver asks for it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray

#: Ray's torch_linear_example, shortened: a linear model fitted by a 2-worker TorchTrainer over gloo.
CALLER = """
import json, os, sys
from air.ray import ray_launch

@ray_launch(num_accelerators=2, accelerator_type="CPU")
def fit(epochs):
    import ray, ray.train, torch
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer, prepare_data_loader, prepare_model

    def train_func(config):
        torch.manual_seed(0)
        x = torch.randn(256, 1)
        data = torch.utils.data.TensorDataset(x, 2 * x + 1)
        loader = prepare_data_loader(torch.utils.data.DataLoader(data, batch_size=32))
        model = prepare_model(torch.nn.Linear(1, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for epoch in range(config["epochs"]):
            for xb, yb in loader:
                loss = torch.nn.functional.mse_loss(model(xb), yb)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            ray.train.report({"loss": loss.item(), "epoch": epoch})

    ray.init()
    TorchTrainer(train_func, train_loop_config={"epochs": epochs}, scaling_config=ScalingConfig(num_workers=2),
                 run_config=RunConfig(storage_path=sys.argv[1], name="linear")).fit()
    return {"mlflow_imported_by_driver": "mlflow" in sys.modules}

assert "mlflow" not in sys.modules and "MLFLOW_RUN_ID" not in os.environ  # no active run anywhere
print("RESULT " + json.dumps(fit.distributed(3)))
"""


def _without_mlflow_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}


def _result(out: subprocess.CompletedProcess[str]) -> object:
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.timeout(600)
def test_ray_launch_without_an_active_run_reports_into_the_calls_run(air_home: Path, tmp_path: Path) -> None:
    from mlflow import MlflowClient

    script = tmp_path / "caller.py"
    script.write_text(textwrap.dedent(CALLER))
    env = _without_mlflow_env()
    env["AIR_RAY_OBJECT_STORE_MEMORY"] = str(100 * 1024 * 1024)
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "results")], capture_output=True, text=True,
                         timeout=540, env=env)
    values = _result(out)
    assert isinstance(values, list) and len(values) == 2 and values[1] is None
    [ref] = list((air_home / "runs").glob("*/attempt_0/tracking.json"))
    run_id = json.loads(ref.read_text())["run_id"]
    client = MlflowClient(f"sqlite:///{air_home}/mlflow.db")
    history = client.get_metric_history(run_id, "loss")
    assert [m.step for m in history] == [0, 1, 2], history  # ray.train.report -> the call's run
    keys = client.get_run(run_id).data.metrics
    assert any(k.startswith("system/ray/") for k in keys), sorted(keys)  # RayMetricsMonitor
    assert client.get_run(run_id).data.tags.get("air.call")


#: The caller's side of a lazily tracked call (air's LazyCallTracking: it makes the run when a rank asks),
#: and one rank, the driver, that has asked for nothing yet when it sets up its tracking.
LATE_CALLER = """
import json, os, subprocess, sys
from air.distributed.tracked import LazyCallTracking
from air.settings import AIR_MLFLOW_ENV_FILE

assert "mlflow" not in sys.modules  # so the run is made only on a rank's request
tracking = LazyCallTracking(sys.argv[1], 0, "fit", {"air.call": sys.argv[1]}, warn=print)
rank = subprocess.run([sys.executable, "-c", sys.argv[2]], env={**os.environ, **tracking.env()},
                      capture_output=True, text=True, timeout=300)
sys.stderr.write(rank.stderr)
made = tracking.handle.run_id if tracking.handle is not None else None
tracking.end("FINISHED")
print("RESULT " + json.dumps({"rank": rank.returncode, "out": rank.stdout, "made": made}))
"""

LATE_DRIVER = """
import json, os
from air.distributed import mlflow_gate
from air.ray.launch import _driver_tracking
from air.settings import AIR_MLFLOW_ENV_FILE

mlflow_gate.install(os.environ[AIR_MLFLOW_ENV_FILE])
assert "MLFLOW_RUN_ID" not in os.environ  # the call's run does not exist yet, nobody has asked for it
monitor = _driver_tracking(0)
print(json.dumps({"run": os.environ.get("MLFLOW_RUN_ID"), "callbacks": os.environ.get("RAY_TRAIN_CALLBACKS", ""),
                  "monitor": monitor is not None}))
"""


@pytest.mark.timeout(400)
def test_the_driver_waits_for_a_late_call_run_before_it_picks_ray_trains_callbacks(air_home: Path) -> None:
    """The run is made only once the driver asks (the slowest possible caller): Ray Train's report callback
    is still added, with the run's id in the driver's environment, so `fit()`'s reports reach it."""
    from air.backends.ray_train_report import CALLBACK_PATH

    env = _without_mlflow_env() | {"AIR_RAY_METRICS": "0"}  # the monitor is the other test's
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(LATE_CALLER), "run-261126-0000a7e1",
                          textwrap.dedent(LATE_DRIVER)], capture_output=True, text=True, timeout=360, env=env)
    result = _result(out)
    assert isinstance(result, dict) and result["rank"] == 0, out.stdout[-3000:] + out.stderr[-3000:]
    driver = json.loads(result["out"].strip().splitlines()[-1])
    assert result["made"] and driver["run"] == result["made"], (result, driver)
    assert CALLBACK_PATH in driver["callbacks"].split(","), driver
    assert driver["monitor"] is False  # AIR_RAY_METRICS=0
