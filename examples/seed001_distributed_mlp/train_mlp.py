"""Seed 001: the document's MLP, trained with DDP once per GPU through `@distributed`.

The code below is the document's, with two changes so it also runs without a GPU: the process group
backend is `air.runtime.default_backend()` ("nccl" on GPUs, as written; "gloo" on CPU ranks) and the
device follows it. The decorator is the document's; `__main__` picks the shape for this machine:

    python train_mlp.py                        # this machine's GPUs (NCCL), or 2 CPU ranks (gloo) without one
                                               # (on CPU a batch of 32, not the document's 1: seconds, not minutes)
    python train_mlp.py --gpus 8 --gpu-type A10 --remote   # as written: 8 A10 of the `ray` profile's cluster
    python train_mlp.py --cpu 2 --samples 256  # tiny, on 2 CPU ranks (what CI runs)

Every rank logs its loss with `mlflow.log_metric`, as in the document: air gives each rank the MLflow
run to log to (MLFLOW_RUN_ID; inside a workload, the workload's run). Each rank returns its epoch
losses, so `.distributed()` gives one result per rank, ordered by rank. Rank 0 prints its progress
through each epoch's steps (a bar every tenth of them), so a long epoch is never silent.
"""

# Define the model
import os

import torch
import torch.distributed as dist
import torch.nn as nn

from air import runtime


def setup():
    backend = runtime.default_backend()  # the document: "nccl"; "gloo" when the ranks are CPU processes
    dist.init_process_group(backend)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))


def cleanup():
    dist.destroy_process_group()


class SimpleMLP(nn.Module):
    def __init__(self, input_dim=10, hidden_dim=64, output_dim=1):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(input_dim, hidden_dim),
            nn.ReLU(),
            nn.Dropout(0.2),
            nn.Linear(hidden_dim, hidden_dim),
            nn.ReLU(),
            nn.Dropout(0.2),
            nn.Linear(hidden_dim, output_dim)
        )

    def forward(self, x):
        return self.net(x)


import serverless_gpu  # noqa: E402,F401 - the document's imports, kept as written
from serverless_gpu import distributed  # noqa: E402


@distributed(gpus=8, gpu_type='A10', remote=True)
def run_train(num_epochs: int, batch_size: int, num_samples: int = 5000) -> dict:
    import mlflow
    import torch.optim as optim
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    # 1. Set up multi node environment
    setup()
    on_gpu = dist.get_backend() == "nccl"
    device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}" if on_gpu else "cpu")

    # 2. Apply the Torch distributed data parallel (DDP) library for data-parellel training.
    model = SimpleMLP().to(device)
    model = DDP(model, device_ids=[device] if on_gpu else None)

    # 3. Create and load dataset.
    x = torch.randn(num_samples, 10)
    y = torch.randn(num_samples, 1)
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset)
    dataloader = DataLoader(dataset, sampler=sampler, batch_size=batch_size)

    # MLflow: air exports MLFLOW_RUN_ID to the ranks; without one (outside air) the document's calls
    # would each create a stray local store, so they are skipped.
    log_metric = mlflow.log_metric if os.environ.get("MLFLOW_RUN_ID") else (lambda *args, **kwargs: None)

    # 4. Define the training loop.
    optimizer = optim.Adam(model.parameters(), lr=0.001)
    loss_fn = nn.MSELoss()
    epoch_losses = []
    for epoch in range(num_epochs):
        sampler.set_epoch(epoch)
        model.train()
        total_loss = 0.0
        for step, (xb, yb) in enumerate(dataloader):
            xb, yb = xb.to(device), yb.to(device)
            optimizer.zero_grad()
            loss = loss_fn(model(xb), yb)
            # Log loss to MLflow metric
            log_metric("loss", loss.item(), step=step)
            loss.backward()
            optimizer.step()
            total_loss += loss.item() * xb.size(0)
            progress(epoch, num_epochs, step + 1, len(dataloader), loss.item())
        log_metric("total_loss", total_loss)
        print(f"Total loss for epoch {epoch}: {total_loss}")
        epoch_losses.append(total_loss)

    cleanup()
    # Not in the document (it returns None): each rank's result comes back from .distributed().
    return {"rank": runtime.get_global_rank(), "device": str(device), "epoch_losses": epoch_losses}


def progress(epoch: int, num_epochs: int, done: int, steps: int, loss: float) -> None:
    """Not in the document: rank 0's progress through an epoch, a line at every tenth of its steps."""
    if runtime.get_global_rank() != 0 or (done % max(1, steps // 10) and done != steps):
        return
    filled = 20 * done // steps
    print(f"epoch {epoch + 1}/{num_epochs} [{'#' * filled}{'.' * (20 - filled)}] step {done}/{steps} "
          f"loss {loss:.4f}", flush=True)


#: The batch of CPU ranks when none is given: the document's 1 makes an epoch of 5,000 samples 2,500 steps
#: per rank, minutes on a small machine; 32 makes it 79, seconds. GPUs keep the document's 1.
CPU_BATCH_SIZE = 32


def main() -> list[dict]:
    import argparse

    from air.accelerators import discover

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, help="number of GPUs (default: all of this machine's)")
    parser.add_argument("--gpu-type", help="GPU model, e.g. A10 or H100 (default: this machine's)")
    parser.add_argument("--remote", action="store_true", help="run on the configured `ray` profile's cluster")
    parser.add_argument("--cpu", type=int, metavar="N", help="N CPU ranks with gloo instead of GPUs")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=None,
                        help=f"default: the document's 1 on GPUs, {CPU_BATCH_SIZE} on CPU ranks; larger is faster")
    parser.add_argument("--samples", type=int, default=5000)
    args = parser.parse_args()

    batch_size = args.batch_size or 1
    if args.remote:
        job = run_train.with_overrides(gpus=args.gpus or run_train.gpus, gpu_type=args.gpu_type or run_train.gpu_type)
    elif args.cpu or not discover().gpus:
        job = run_train.with_overrides(num_accelerators=args.cpu or 2, accelerator_type="CPU", remote=False)
        if args.batch_size is None:
            batch_size = CPU_BATCH_SIZE
            print(f"CPU ranks: batch size {batch_size} (the document's 1 is for GPUs: --batch-size 1 for it)")
    else:
        job = run_train.with_overrides(num_accelerators=args.gpus, accelerator_type=args.gpu_type or "GPU",
                                       remote=False)
    results = job.distributed(num_epochs=args.epochs, batch_size=batch_size, num_samples=args.samples)
    for result in results:
        print(result)
    print(f"OK: {len(results)} rank(s) trained the MLP with DDP; every rank's result came back.")
    return results


if __name__ == "__main__":
    main()
