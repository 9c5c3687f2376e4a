"""A small DDP regression, as a user would write it for torchrun; reads air's HYPERPARAMETERS_PATH."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main() -> None:
    params = {"epochs": 2, "lr": 0.01, "batch_size": 64}
    if os.environ.get("HYPERPARAMETERS_PATH"):
        with open(os.environ["HYPERPARAMETERS_PATH"]) as fh:
            params.update(yaml.safe_load(fh) or {})
    backend = "nccl" if torch.cuda.is_available() and os.environ.get("AIR_ACCELERATOR_KIND") != "CPU" else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device(f"cuda:{local_rank}" if backend == "nccl" else "cpu")
    torch.manual_seed(0)
    x = torch.randn(2048, 8)
    y = x.sum(dim=1, keepdim=True) + 0.05 * torch.randn(2048, 1)
    sampler = DistributedSampler(TensorDataset(x, y))
    loader = DataLoader(TensorDataset(x, y), sampler=sampler, batch_size=params["batch_size"])
    model = DDP(torch.nn.Linear(8, 1).to(device), device_ids=[local_rank] if backend == "nccl" else None)
    opt = torch.optim.SGD(model.parameters(), lr=params["lr"])
    mlflow = None
    if rank == 0 and os.environ.get("MLFLOW_RUN_ID"):
        import mlflow  # MLFLOW_RUN_ID and MLFLOW_TRACKING_URI come from air: no set-up needed
    for epoch in range(params["epochs"]):
        sampler.set_epoch(epoch)
        total = 0.0
        for xb, yb in loader:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(xb.to(device)), yb.to(device))
            loss.backward()
            opt.step()
            total += loss.item() * len(xb)
        if rank == 0:
            epoch_loss = total / len(sampler)
            print(f"epoch {epoch}: loss {epoch_loss:.4f} (world size {world}, node {os.environ.get('NODE_RANK')})")
            if mlflow is not None:
                mlflow.log_metric("loss", epoch_loss, step=epoch)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
