"""`@ray_launch` without an active MLflow run (issue 24): the call's MLflow run is made lazily (no
caller run, mlflow not imported by the caller, MLFLOW_RUN_ID not set), and Ray Train's reports and Ray's
system metrics still reach it although the function never imports mlflow."""

from __future__ import annotations

import json
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


@pytest.mark.timeout(600)
def test_ray_launch_without_an_active_run_reports_into_the_calls_run(air_home: Path, tmp_path: Path) -> None:
    from mlflow import MlflowClient

    script = tmp_path / "caller.py"
    script.write_text(textwrap.dedent(CALLER))
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("MLFLOW_")}
    env["AIR_RAY_OBJECT_STORE_MEMORY"] = str(100 * 1024 * 1024)
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "results")], capture_output=True, text=True,
                         timeout=540, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    values = json.loads(line[len("RESULT "):])
    assert len(values) == 2 and values[1] is None
    [ref] = list((air_home / "runs").glob("*/attempt_0/tracking.json"))
    run_id = json.loads(ref.read_text())["run_id"]
    client = MlflowClient(f"sqlite:///{air_home}/mlflow.db")
    history = client.get_metric_history(run_id, "loss")
    assert [m.step for m in history] == [0, 1, 2], history  # ray.train.report -> the call's run
    keys = client.get_run(run_id).data.metrics
    assert any(k.startswith("system/ray/") for k in keys), sorted(keys)  # RayMetricsMonitor
    assert client.get_run(run_id).data.tags.get("air.call")
