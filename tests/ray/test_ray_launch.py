"""`ray_launch`: a Ray cluster per call over the call's ranks, the function as its driver on rank 0.

These run locally (remote=False, one node): CPU ranks for a real Ray Train TorchTrainer, and ranks on
fake "H100" GPUs (AIR_FAKE_GPUS) to show that the cluster air starts advertises GPUs and the
accelerator type, so ScalingConfig(use_gpu=True, accelerator_type="H100") and fractional GPUs schedule
while a type no node has does not.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import psutil
import pytest

from air.ray import ray_launch

pytestmark = pytest.mark.ray


def processes_of_calls(air_home: Path) -> list[int]:
    """Processes started for calls under this AIR_HOME (ranks, and the Ray nodes they started)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("AIR_CALL_DIR", "").startswith(str(air_home)):
                found.append(proc.pid)
        except psutil.Error:
            continue
    return found


@pytest.mark.timeout(600)  # a Ray cluster and Ray Train on 2 busy cores: minutes, not seconds
def test_ray_launch_runs_a_torch_trainer_and_reports_to_mlflow(air_home: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("ray-launch-test")).info.run_id
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_RUN_ID", run_id)
    monkeypatch.setenv("AIR_RAY_OBJECT_STORE_MEMORY", str(100 * 1024 * 1024))
    storage = tmp_path / "ray_results"

    @ray_launch(num_accelerators=2, accelerator_type="CPU")
    def fit(steps: int) -> dict:
        import tempfile

        import ray
        import ray.train
        import torch
        from ray.train import Checkpoint, RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer, prepare_model

        def train_func(config: dict) -> None:
            torch.manual_seed(0)
            model = prepare_model(torch.nn.Linear(4, 1))  # DDP over gloo, 2 workers
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            x, y = torch.randn(64, 4), torch.randn(64, 1)
            for step in range(config["steps"]):
                loss = torch.nn.functional.mse_loss(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                if step == config["steps"] - 1:  # Ray Train v2 keeps the metrics of checkpoints
                    with tempfile.TemporaryDirectory() as folder:
                        torch.save(model.module.state_dict(), os.path.join(folder, "model.pt"))
                        ray.train.report({"loss": loss.item(), "step": step},
                                         checkpoint=Checkpoint.from_directory(folder))
                else:
                    ray.train.report({"loss": loss.item(), "step": step})

        ray.init()  # RAY_ADDRESS points at the call's own cluster
        trainer = TorchTrainer(train_func, train_loop_config={"steps": steps},
                               scaling_config=ScalingConfig(num_workers=2),
                               run_config=RunConfig(storage_path=str(storage), name="t"))
        result = trainer.fit()
        return {"metrics": dict(result.metrics), "checkpoint": result.checkpoint is not None,
                "cpus": ray.cluster_resources().get("CPU"), "address": os.environ["RAY_ADDRESS"]}

    values = fit.distributed(3)
    assert len(values) == 2 and values[1] is None
    assert values[0]["metrics"]["step"] == 2 and values[0]["checkpoint"] and values[0]["cpus"] >= 2
    assert values[0]["address"].endswith(":" + values[0]["address"].rsplit(":", 1)[1])
    history = client.get_metric_history(run_id, "loss")
    assert [m.step for m in history] == [0, 1, 2]  # ray.train.report → MLflow, on by default
    keys = client.get_run(run_id).data.metrics
    assert any(k.startswith("system/ray/") for k in keys), sorted(keys)  # RayMetricsMonitor
    assert not processes_of_calls(air_home)


@pytest.mark.timeout(600)  # a Ray cluster and Ray Train on 2 busy cores: minutes, not seconds
def test_accelerator_type_and_fractional_gpus_schedule_on_the_nodes_that_advertise_them(
        air_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIR_FAKE_GPUS", "2:H100")
    monkeypatch.setenv("AIR_RAY_OBJECT_STORE_MEMORY", str(100 * 1024 * 1024))
    monkeypatch.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "5")
    out = tmp_path / "workers"
    out.mkdir()

    @ray_launch(num_accelerators=2, gpu_type="H100")
    def schedule() -> dict:
        import ray
        import ray.train
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

        def loop() -> None:
            rank = ray.train.get_context().get_world_rank()
            (out / f"{rank}.json").write_text(json.dumps({"cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
                                                          "gpus": ray.get_gpu_ids()}))

        def trainer(accelerator: str) -> DataParallelTrainer:
            return DataParallelTrainer(
                loop, scaling_config=ScalingConfig(num_workers=2, use_gpu=True, accelerator_type=accelerator,
                                                   resources_per_worker={"GPU": 0.5}),
                run_config=RunConfig(storage_path=str(tmp_path / "results"), name=accelerator,
                                     # Ray Train waits for capacity forever by default; fail on the first timeout.
                                     failure_config=FailureConfig(controller_failure_limit=0)))

        ray.init()
        trainer("H100").fit()
        try:
            trainer("A100").fit()
            refused = None
        except Exception as exc:  # shown to the test
            refused = f"{type(exc).__name__}: {exc}"
        return {"resources": ray.cluster_resources(), "refused": refused}

    values = schedule.distributed()
    assert values[1] is None
    resources = values[0]["resources"]
    assert resources["GPU"] == 2 and resources["accelerator_type:H100"] == 1
    workers = [json.loads((out / f"{r}.json").read_text()) for r in range(2)]
    assert all(len(w["gpus"]) == 1 for w in workers)  # half a GPU each: both see one device
    print("A100 request:", values[0]["refused"])
    assert values[0]["refused"] is not None
    assert not processes_of_calls(air_home)
