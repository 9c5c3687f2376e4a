"""Seed 001, "launching with Ray": `ray_launch` starts a Ray cluster over the call's GPUs and runs the
function once, as the Ray driver; inside it, plain Ray (here Ray Train) uses the whole cluster.

    python ray_launch_mlp.py                 # this machine's GPUs, or 2 CPU slots without a GPU
    python ray_launch_mlp.py --gpus 16 --gpu-type A10 --remote   # as written: a `ray` profile's cluster
    python ray_launch_mlp.py --cpu 2 --only train                # what CI runs

`foo` is the document's function. `train` is the document's MLP trained with Ray Train's TorchTrainer
on every accelerator of that cluster (one worker per GPU, or per CPU slot): the shape of the ResNet-18
notebook the document links to, small enough to run anywhere.
`.distributed()` returns one entry per rank: the driver's value at rank 0, None for the others.
"""

from __future__ import annotations

from serverless_gpu.ray import ray_launch


@ray_launch(gpus=16, remote=True, gpu_type='A10')
def foo():
    import os  # noqa: F401 - as in the document

    import ray

    ray.init()  # RAY_ADDRESS points at the cluster ray_launch started for this call
    # The document's `ray.state` module is gone from Ray 2.x; the same function lives in ray._private.state.
    print(ray._private.state.available_resources_per_node())
    return 1


@ray_launch(gpus=16, remote=True, gpu_type='A10')
def train(num_epochs: int = 3, batch_size: int = 64, num_samples: int = 5000) -> dict:
    import os
    import tempfile

    import ray.train
    import torch
    import torch.nn as nn
    from ray.train import Checkpoint, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer, prepare_data_loader, prepare_model
    from torch.utils.data import DataLoader, TensorDataset

    import ray

    def simple_mlp(input_dim: int = 10, hidden_dim: int = 64, output_dim: int = 1) -> nn.Module:
        """The document's SimpleMLP (train_mlp.py), inline so the Ray workers need no module of ours."""
        return nn.Sequential(nn.Linear(input_dim, hidden_dim), nn.ReLU(), nn.Dropout(0.2),
                             nn.Linear(hidden_dim, hidden_dim), nn.ReLU(), nn.Dropout(0.2),
                             nn.Linear(hidden_dim, output_dim))

    def train_func(config: dict) -> None:
        torch.manual_seed(0)
        x, y = torch.randn(config["num_samples"], 10), torch.randn(config["num_samples"], 1)
        loader = prepare_data_loader(DataLoader(TensorDataset(x, y), batch_size=config["batch_size"], shuffle=True))
        model = prepare_model(simple_mlp())
        optimizer = torch.optim.Adam(model.parameters(), lr=0.001)
        loss_fn = nn.MSELoss()
        for epoch in range(config["num_epochs"]):
            if ray.train.get_context().get_world_size() > 1:
                loader.sampler.set_epoch(epoch)
            total_loss = 0.0
            for xb, yb in loader:
                optimizer.zero_grad()
                loss = loss_fn(model(xb), yb)
                loss.backward()
                optimizer.step()
                total_loss += loss.item() * xb.size(0)
            # Ray Train 2.x keeps the metrics that come with a checkpoint as the result's metrics.
            with tempfile.TemporaryDirectory() as folder:
                torch.save(model.module.state_dict() if hasattr(model, "module") else model.state_dict(),
                           os.path.join(folder, "model.pt"))
                ray.train.report({"epoch": epoch, "total_loss": total_loss},
                                 checkpoint=Checkpoint.from_directory(folder))

    ray.init()  # RAY_ADDRESS points at the cluster ray_launch started for this call
    gpus = int(ray.cluster_resources().get("GPU", 0))
    workers = gpus or int(os.environ.get("LOCAL_WORLD_SIZE", "1")) * int(os.environ.get("NUM_NODES", "1"))
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"num_epochs": num_epochs, "batch_size": batch_size, "num_samples": num_samples},
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=gpus > 0),
        run_config=RunConfig(storage_path=os.environ.get("RAY_STORAGE_PATH", tempfile.gettempdir()),
                             name=f"ray-launch-mlp-{os.getpid()}"),
    )
    result = trainer.fit()
    return {"workers": workers, "use_gpu": gpus > 0, "metrics": dict(result.metrics or {}),
            "resources": {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")}}


def main() -> None:
    import argparse

    from air.accelerators import discover

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, help="number of GPUs (default: all of this machine's)")
    parser.add_argument("--gpu-type", help="GPU model, e.g. A10 or H100 (default: this machine's)")
    parser.add_argument("--remote", action="store_true", help="run on the configured `ray` profile's cluster")
    parser.add_argument("--cpu", type=int, metavar="N", help="N CPU slots instead of GPUs")
    parser.add_argument("--only", choices=["foo", "train"], help="run just one of the two functions")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=5000)
    args = parser.parse_args()

    def shaped(fn):  # the document's decorator as written with --remote, else this machine
        if args.remote:
            return fn.with_overrides(gpus=args.gpus or fn.gpus, gpu_type=args.gpu_type or fn.gpu_type)
        if args.cpu or not discover().gpus:
            return fn.with_overrides(num_accelerators=args.cpu or 2, accelerator_type="CPU", remote=False)
        return fn.with_overrides(num_accelerators=args.gpus, accelerator_type=args.gpu_type or "GPU", remote=False)

    if args.only in (None, "foo"):
        print("foo:", shaped(foo).distributed())
    if args.only in (None, "train"):
        results = shaped(train).distributed(num_epochs=args.epochs, num_samples=args.samples)
        print("train:", results)
        print(f"OK: Ray Train ran {results[0]['workers']} worker(s) on the cluster ray_launch started.")


if __name__ == "__main__":
    main()
