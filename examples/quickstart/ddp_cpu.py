"""The main job, on any machine: a small DDP training run once per accelerator with @distributed.

On a machine without a GPU it runs 2 CPU ranks with gloo; with GPUs, pass `--gpus N` to use N GPUs of
this machine with NCCL. The only differences are the backend and the device.
"""

from __future__ import annotations

import argparse
from air import distributed, runtime


@distributed(num_accelerators=2, accelerator_type="CPU")
def train(epochs: int = 3, batch_size: int = 64) -> dict[str, float]:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    backend = runtime.default_backend()
    dist.init_process_group(backend)
    local_rank = runtime.get_local_rank()
    device = torch.device(f"cuda:{local_rank}" if backend == "nccl" else "cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)

    torch.manual_seed(0)
    x = torch.randn(4096, 10)
    y = x @ torch.randn(10, 1) + 0.1 * torch.randn(4096, 1)
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset)
    loader = DataLoader(dataset, sampler=sampler, batch_size=batch_size)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(10, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(device),
                device_ids=[local_rank] if backend == "nccl" else None)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    loss_fn = torch.nn.MSELoss()
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        total = 0.0
        for xb, yb in loader:
            xb, yb = xb.to(device), yb.to(device)
            optimizer.zero_grad()
            loss = loss_fn(model(xb), yb)
            loss.backward()
            optimizer.step()
            total += loss.item() * len(xb)
        if runtime.get_global_rank() == 0:
            print(f"epoch {epoch}: loss {total / len(sampler):.4f}")
    checksum = float(sum(p.detach().sum() for p in model.parameters()))
    dist.destroy_process_group()
    return {"rank": runtime.get_global_rank(), "final_loss": total / len(sampler), "param_checksum": checksum}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gpus", type=int, default=0, help="run on this many GPUs of this machine (NCCL)")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    # accelerator_type="GPU": this machine's GPUs, whatever their model (NCCL instead of gloo).
    job = train.with_overrides(num_accelerators=args.gpus, accelerator_type="GPU") if args.gpus else train
    results = job.distributed(epochs=args.epochs)
    for result in results:
        print(result)
    assert len({round(r["param_checksum"], 6) for r in results}) == 1, "ranks disagree on the parameters"
    print(f"OK: {len(results)} ranks trained one model with DDP; every rank's result came back.")
