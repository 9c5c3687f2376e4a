"""Step 3 of the tutorial: Ray Data for ingestion (`get_dataset_shard`, `iter_torch_batches`).

    python step3_ray_data.py      # on the Ray cluster of RAY_ADDRESS (else Ray starts a local one)
    air run -f workload.yaml --watch --override env_variables.STEP=3   # as a workload on air

The code is the tutorial's; the Parquet comes from CIFAR10_PARQUET (default: the tutorial's
s3://ray-example-data/cifar10-parquet; offline, the folder make_fake_cifar.py writes), and, as in
step 2, NUM_WORKERS / USE_GPU / RAY_STORAGE_PATH come from the environment.
"""

import os
import tempfile

import numpy as np
import ray
import ray.data
import ray.train
import torch
from cifar import (
    DEFAULT_PARQUET,
    Normalize,
    ToTensor,
    backend_note,
    env,
    load_checkpoint,
    make_vit,
    run_name,
    runtime_env,
    storage_path,
    transforms,
)
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from torch import nn
from tqdm import tqdm

HERE = os.path.dirname(os.path.abspath(__file__))
STORAGE_PATH = env("CIFAR10_PARQUET", DEFAULT_PARQUET)


def transform_cifar(row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    # Define the torchvision transform.
    transform = transforms.Compose([ToTensor(), Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))])
    row["image"] = transform(row["image"])
    return row


def train_func_per_worker(config: dict):
    lr = config["lr"]
    epochs = config["epochs"]
    batch_size = config["batch_size_per_worker"]

    # [1] Prepare `Dataloader` for distributed training.
    # The get_dataset_shard method gets the associated dataset shard to pass to the
    # TorchTrainer constructor in the next code block.
    # The iter_torch_batches method lazily shards the dataset among workers.
    # =============================================================================
    train_data_shard = ray.train.get_dataset_shard("train")
    valid_data_shard = ray.train.get_dataset_shard("valid")
    train_dataloader = train_data_shard.iter_torch_batches(batch_size=batch_size)
    valid_dataloader = valid_data_shard.iter_torch_batches(batch_size=batch_size)

    model = make_vit()  # VisionTransformer(image_size=32, patch_size=4, ..., num_classes=10)
    # A retried attempt of an air run resumes from its last checkpoint (AIR_CHECKPOINT_DIR is kept).
    first_epoch = load_checkpoint(model)

    model = ray.train.torch.prepare_model(model)

    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-2)

    # Model training loop.
    for epoch in range(first_epoch, epochs):
        model.train()
        for batch in tqdm(train_dataloader, desc=f"Train Epoch {epoch}"):
            X, y = batch['image'], batch['label']
            pred = model(X)
            loss = loss_fn(pred, y)

            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

        model.eval()
        valid_loss, num_correct, num_total, num_batches = 0, 0, 0, 0
        with torch.no_grad():
            for batch in tqdm(valid_dataloader, desc=f"Valid Epoch {epoch}"):
                # [2] Each Ray Data batch is a dict so you must access the
                # underlying data using the appropriate keys.
                # =======================================================
                X, y = batch['image'], batch['label']
                pred = model(X)
                loss = loss_fn(pred, y)

                valid_loss += loss.item()
                num_total += y.shape[0]
                num_batches += 1
                num_correct += (pred.argmax(1) == y).sum().item()

        valid_loss /= num_batches
        accuracy = num_correct / num_total

        with tempfile.TemporaryDirectory() as temp_checkpoint_dir:
            with open(os.path.join(temp_checkpoint_dir, "epoch"), "w") as fh:
                fh.write(str(epoch))
            torch.save(
                # `model.module`: DDP's wrapped model (with one worker prepare_model does not wrap).
                getattr(model, "module", model).state_dict(),
                os.path.join(temp_checkpoint_dir, "model.pt")
            )
            ray.train.report(
                metrics={"loss": valid_loss, "accuracy": accuracy},
                checkpoint=ray.train.Checkpoint.from_directory(temp_checkpoint_dir),
            )
            if ray.train.get_context().get_world_rank() == 0:
                print({"epoch_num": epoch, "loss": valid_loss, "accuracy": accuracy})


def train_cifar_10(num_workers, use_gpu):
    global_batch_size = env("GLOBAL_BATCH_SIZE", 512)

    train_config = {
        "lr": env("LR", 1e-3),
        "epochs": env("EPOCHS", 1),
        "batch_size_per_worker": global_batch_size // num_workers,
    }

    # Configure computation resources.
    scaling_config = ScalingConfig(num_workers=num_workers, use_gpu=use_gpu)
    run_config = RunConfig(
        storage_path=storage_path(),
        name=run_name("train_data_run"),
    )

    # Initialize a Ray TorchTrainer.
    trainer = TorchTrainer(
        train_loop_per_worker=train_func_per_worker,
        # [1] With Ray Data you pass the Dataset directly to the Trainer.
        # ==============================================================
        datasets={"train": train_dataset, "valid": test_dataset},
        train_loop_config=train_config,
        scaling_config=scaling_config,
        run_config=run_config,
    )

    result = trainer.fit()
    print(f"Training result: {result}")
    return result


if __name__ == "__main__":
    # The workers import cifar.py (and the fallback) from this folder and read the same settings.
    ray.init(runtime_env=runtime_env(HERE))
    print(f"step 3: Ray Train + Ray Data on {ray.cluster_resources()}, transforms from {backend_note()}")

    train_dataset = ray.data.read_parquet(f'{STORAGE_PATH}/train')
    test_dataset = ray.data.read_parquet(f'{STORAGE_PATH}/test')
    print(train_dataset.schema())
    print(test_dataset.schema())

    train_dataset = train_dataset.map(transform_cifar)
    test_dataset = test_dataset.map(transform_cifar)

    train_cifar_10(num_workers=env("NUM_WORKERS", 8), use_gpu=env("USE_GPU", True))
