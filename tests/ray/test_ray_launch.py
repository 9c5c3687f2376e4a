"""`ray_launch`: a Ray cluster per call over the call's ranks, the function as its driver on rank 0.

These run locally (remote=False, one node): ranks on fake "H100" GPUs (AIR_FAKE_GPUS) show that the
cluster air starts advertises GPUs and the accelerator type, so ScalingConfig(use_gpu=True,
accelerator_type="H100") and fractional GPUs schedule while a type no node has does not. A real Ray Train
TorchTrainer on CPU ranks, reporting into the caller's MLflow run, is seed 001's example
(tests/seeds/test_seed001_distributed_mlp.py).
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
