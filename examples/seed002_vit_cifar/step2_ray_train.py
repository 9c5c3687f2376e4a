"""Step 2 of the tutorial: distribute the training with Ray Train (DDP over the cluster's workers).

    python step2_ray_train.py     # on the Ray cluster of RAY_ADDRESS (else Ray starts a local one)
    air run -f workload.yaml --watch --override env_variables.STEP=2   # as a workload on air

The code is the tutorial's; `train_cifar_10(num_workers=8, use_gpu=True)` takes NUM_WORKERS / USE_GPU
from the environment, the checkpoints go to RAY_STORAGE_PATH (the tutorial's /mnt/cluster_storage is
Anyscale's), and this folder and those settings reach the workers through the job's runtime_env.
"""

import os
import tempfile

import ray
import ray.train
import torch
from cifar import (
    backend_note,
    env,
    get_dataloaders,
    load_checkpoint,
    make_vit,
    run_name,
    runtime_env,
    storage_path,
)
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from torch import nn
from tqdm import tqdm

HERE = os.path.dirname(os.path.abspath(__file__))


def train_func_per_worker(config: dict):
    lr = config["lr"]
    epochs = config["epochs"]
    batch_size = config["batch_size_per_worker"]

    # Get data loaders inside the worker training function.
    train_dataloader, valid_dataloader = get_dataloaders(batch_size=batch_size)

    # [1] Prepare data loader for distributed training.
    # The prepare_data_loader method assigns unique rows of data to each worker so that
    # the model sees each row once per epoch.
    # NOTE: This approach only works for map-style datasets. For a general distributed
    # preprocessing and sharding solution, see the next part using Ray Data for data
    # ingestion.
    # =================================================================================
    train_dataloader = ray.train.torch.prepare_data_loader(train_dataloader)
    valid_dataloader = ray.train.torch.prepare_data_loader(valid_dataloader)

    model = make_vit()  # VisionTransformer(image_size=32, patch_size=4, ..., num_classes=10)
    # A retried attempt of an air run resumes from its last checkpoint (AIR_CHECKPOINT_DIR is kept).
    first_epoch = load_checkpoint(model)

    # [2] Prepare and wrap your model with DistributedDataParallel.
    # The prepare_model method moves the model to the correct GPU/CPU device.
    # =======================================================================
    model = ray.train.torch.prepare_model(model)

    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-2)

    # Model training loop.
    for epoch in range(first_epoch, epochs):
        if ray.train.get_context().get_world_size() > 1:
            # Required for the distributed sampler to shuffle properly across epochs.
            train_dataloader.sampler.set_epoch(epoch)

        model.train()
        for X, y in tqdm(train_dataloader, desc=f"Train Epoch {epoch}"):
            pred = model(X)
            loss = loss_fn(pred, y)

            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

        model.eval()
        valid_loss, num_correct, num_total = 0, 0, 0
        with torch.no_grad():
            for X, y in tqdm(valid_dataloader, desc=f"Valid Epoch {epoch}"):
                pred = model(X)
                loss = loss_fn(pred, y)

                valid_loss += loss.item()
                num_total += y.shape[0]
                num_correct += (pred.argmax(1) == y).sum().item()

        valid_loss /= len(train_dataloader)  # (sic) the tutorial divides by the train loader's length
        accuracy = num_correct / num_total

        # [3] (Optional) Report checkpoints and attached metrics to Ray Train.
        # ====================================================================
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

    # [1] Start distributed training.
    # Define computation resources for workers.
    # Run `train_func_per_worker` on those workers.
    # =============================================
    scaling_config = ScalingConfig(num_workers=num_workers, use_gpu=use_gpu)
    run_config = RunConfig(
        # /mnt/cluster_storage is an Anyscale-specific storage path.
        # OSS users should set up this path themselves: here RAY_STORAGE_PATH.
        storage_path=storage_path(),
        name=run_name("train_run"),
    )
    trainer = TorchTrainer(
        train_loop_per_worker=train_func_per_worker,
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
    print(f"step 2: Ray Train on {ray.cluster_resources()}, models and data from {backend_note()}")
    train_cifar_10(num_workers=env("NUM_WORKERS", 8), use_gpu=env("USE_GPU", True))
