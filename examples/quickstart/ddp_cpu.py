"""The main job, on any machine: a small DDP training run once per accelerator with @distributed.

On a machine without a GPU it runs 2 CPU ranks with gloo; with GPUs, pass `--gpus N` to use N GPUs of
this machine with NCCL. The only differences are the backend and the device.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

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
    model = DDP(
        torch.nn.Sequential(torch.nn.Linear(10, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(device),
        device_ids=[local_rank] if backend == "nccl" else None,
    )
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


def _shown(path: Path) -> str:
    """`path` relative to the current folder when it is inside it (shorter to copy), else absolute."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def where_things_went(func_name: str, wait_s: float = 30.0) -> str:
    """Where the last call of `func_name` left its rank logs and MLflow run, and the commands that show them.

    The MLflow run of a call whose ranks never imported mlflow is recorded just after it returns, by a
    short-lived process; this waits up to `wait_s` for it to say which run it made.
    """
    from air.home import air_home
    from air.store.paths import CallPaths
    from air.store.run_store import RunStore
    from air.tracking import DEFAULT_CALL_EXPERIMENT, run_url, tracking_uri

    home = air_home()
    # Every call is a run of kind `call` in the run store; its attempt's folder holds the rank logs.
    calls = [r for r in RunStore().list_runs(statuses="all", limit=50) if r.kind == "call" and r.run_name == func_name]
    lines = ["", f"Where things went (AIR_HOME={home}):"]
    link = None
    run_id = None
    if calls:
        run_id = calls[0].id
        folder = CallPaths(run_id).attempt_dir(0)
        lines.append(f"  run:         {run_id} (a @distributed call)")
        lines.append(f"  rank logs:   {_shown(folder)}/rank_<N>.log")
        env_file = CallPaths(run_id).mlflow_env(0)
        deadline = time.monotonic() + wait_s
        while not env_file.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        try:
            mlflow_env = json.loads(env_file.read_text())
        except (OSError, ValueError):
            mlflow_env = {}
        if mlflow_env.get("MLFLOW_RUN_ID"):
            mlflow_run, experiment_id = mlflow_env["MLFLOW_RUN_ID"], mlflow_env["MLFLOW_EXPERIMENT_ID"]
            lines.append(
                f"  MLflow run:  {mlflow_run} (experiment '{DEFAULT_CALL_EXPERIMENT}') in {tracking_uri()}"
            )
            link = run_url(mlflow_run, experiment_id)
        else:
            lines.append(f"  MLflow runs: {tracking_uri()} (experiment '{DEFAULT_CALL_EXPERIMENT}')")
    air_bin = Path(sys.executable).parent / "air"
    air = _shown(air_bin) if air_bin.exists() else "air"
    default_home = (Path.home() / ".air").resolve()
    prefix = f"AIR_HOME={_shown(home)} " if home != default_home else ""
    lines += [
        "See them:",
        f"  {prefix}{air} list runs      # runs and calls, newest first",
        *([f"  {prefix}{air} logs {run_id} --rank 0   # rank 0's lines"] if run_id else []),
        f"  {prefix}{air} ui             # air's pages (http://127.0.0.1:5001/runs) and MLflow's UI"
        + (f": {link}" if link else ""),
    ]
    if air_bin.exists():
        lines.append(
            f"  (`air` lives in {_shown(air_bin.parent)}: `source {_shown(air_bin.parent / 'activate')}` "
            "puts it on PATH)"
        )
    return "\n".join(lines)


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
    print(where_things_went("train"))
