"""A Ray Train TorchTrainer (2 workers) that checkpoints every step and crashes in attempt 0: run by
test_ray_train_resume.py as the driver of a 2-node workload. It sets no storage_path: air gives it
AIR_CHECKPOINT_DIR, so attempt 1's `ray.train.get_checkpoint()` returns attempt 0's last checkpoint."""

import os
import tempfile
import time

import ray
import ray.train
import torch
from ray.train import Checkpoint, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

STEPS = 6
CRASH_AFTER = 3  # attempt 0 dies once this many steps are checkpointed


def train_func() -> None:
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            start = int(open(os.path.join(folder, "step")).read())
    rank = ray.train.get_context().get_world_rank()
    print(f"worker {rank} starts at step {start}", flush=True)
    for step in range(start, STEPS):
        loss = float(torch.tensor(1.0 / (step + 1)))
        with tempfile.TemporaryDirectory() as tmp:
            with open(os.path.join(tmp, "step"), "w") as fh:
                fh.write(str(step + 1))
            ray.train.report({"step": step + 1, "loss": loss},
                             checkpoint=Checkpoint.from_directory(tmp) if rank == 0 else None)


def main() -> None:
    ray.init(address="auto")
    deadline = time.time() + 90
    while len([n for n in ray.nodes() if n["Alive"]]) < 2 and time.time() < deadline:
        time.sleep(0.5)
    print("alive nodes:", len([n for n in ray.nodes() if n["Alive"]]), flush=True)
    attempt = int(os.environ["AIR_ATTEMPT"])
    steps_run = STEPS if attempt > 0 else CRASH_AFTER
    globals()["STEPS"] = steps_run
    trainer = TorchTrainer(train_func, scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                           run_config=RunConfig())
    result = trainer.fit()
    with result.checkpoint.as_directory() as folder:
        reached = open(os.path.join(folder, "step")).read()
    print(f"attempt {attempt} resumed={os.environ['AIR_RESUMED']} reached step {reached} "
          f"storage {result.path}", flush=True)
    if attempt == 0:
        raise SystemExit("simulated crash after a checkpoint")


if __name__ == "__main__":
    main()
