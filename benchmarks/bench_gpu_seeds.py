"""GPU benchmark of the seed examples: what a user of this machine gets from each way of running them.

1. Seed 002's ViT epoch (the tutorial's model and batch size, CIFAR-10 shapes: 50,000 training images):
   a. the plain single-GPU script (step 1's loop),
   b. the same loop with DDP on every GPU through `@distributed`,
   c. Ray Train on air (`ray_launch` starts the Ray cluster; TorchTrainer with `prepare_model` /
      `prepare_data_loader`, as step 2),
   each as seconds per epoch and images per second.
2. Seed 000's fine-tune (Ray Train on air, DDP, bf16, AdamW, batch 4 per GPU, sequences of 1024 tokens,
   as train_ray.py): tokens per second and model FLOPs utilisation,
   MFU = 6 · parameters · tokens / seconds / (GPUs · peak bf16 FLOP/s of the GPU model, from PEAK_BF16).
   The model is Qwen2.5-3B's architecture built from its config with random weights: the lent GPU
   machines have no internet, and throughput does not depend on the weights.

    python benchmarks/bench_gpu_seeds.py                  # everything, on every GPU of this machine
    python benchmarks/bench_gpu_seeds.py --only vit --gpus 1
    python benchmarks/bench_gpu_seeds.py --json results.json

It refuses to run without a GPU (exit 2). `--cpu-smoke` runs every path tiny on CPU (gloo) to check the
script itself; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SEED002 = ROOT / "examples" / "seed002_vit_cifar"
sys.path.insert(0, str(SEED002))

#: Dense bf16 tensor-core peak per GPU, FLOP/s (vendor data sheets; SXM parts where both exist).
PEAK_BF16: dict[str, float] = {
    "B200": 2250e12, "H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12,
    "L40S": 362e12, "L40": 181e12, "A6000": 155e12, "A10": 125e12, "L4": 121e12, "V100": 125e12, "T4": 65e12,
}
#: H100 PCIe has a lower peak than the SXM part the table assumes.
PEAK_BY_NAME = {"H100 PCIe": 756e12, "H100 NVL": 835e12}

#: Qwen2.5-3B's architecture (its config.json): the seed's model, built without downloading it.
QWEN25_3B = {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
             "num_attention_heads": 16, "num_key_value_heads": 2, "max_position_embeddings": 32768,
             "tie_word_embeddings": True, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6}
TINY_QWEN2 = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
              "tie_word_embeddings": True}


def gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"


def peak_flops(name: str) -> float | None:
    """Peak bf16 FLOP/s of one GPU named `name` (torch's device name), or None if not in the table."""
    for fragment, peak in PEAK_BY_NAME.items():
        if fragment in name:
            return peak
    from air.accelerators import normalize_model

    model = normalize_model(name)
    return PEAK_BF16.get(model or "")


# -- seed 002: one ViT epoch three ways ------------------------------------------------------------------


def vit_epoch(rank_batch: int, distributed: bool, max_steps: int | None) -> dict[str, float]:
    """Step 1's training loop for one epoch on this process's device; DDP when `distributed`."""
    import torch
    from cifar import get_dataloaders, make_vit
    from torch import nn
    from torch.utils.data import DataLoader, DistributedSampler

    cuda = torch.cuda.is_available()
    if distributed:
        import torch.distributed as dist

        dist.init_process_group("nccl" if cuda else "gloo")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device(f"cuda:{local}" if cuda else "cpu")
        if cuda:
            torch.cuda.set_device(device)
    else:
        device = torch.device("cuda" if cuda else "cpu")
    train_loader, _ = get_dataloaders(batch_size=rank_batch)
    if distributed:
        train_loader = DataLoader(train_loader.dataset, batch_size=rank_batch,
                                  sampler=DistributedSampler(train_loader.dataset))
    model = make_vit().to(device)
    if distributed:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device] if cuda else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2)
    loss_fn = nn.CrossEntropyLoss()
    return _timed_epoch(model, train_loader, optimizer, loss_fn, device, max_steps)


def _timed_epoch(model: Any, loader: Any, optimizer: Any, loss_fn: Any, device: Any,
                 max_steps: int | None, to_device: bool = True) -> dict[str, float]:
    """One pass over `loader` (or its first max_steps batches), timed after one warm-up step."""
    import torch

    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    model.train()
    images, start, steps = 0, None, 0
    for X, y in loader:
        if to_device:
            X, y = X.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = loss_fn(model(X), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        steps += 1
        if start is None:  # the first step compiles kernels and fills caches: not part of the epoch
            sync()
            start = time.perf_counter()
            continue
        images += len(X)
        if max_steps and steps >= max_steps:
            break
    sync()
    seconds = time.perf_counter() - (start or time.perf_counter())
    return {"seconds": seconds, "images": images, "steps": steps - 1}


def bench_vit_plain(args: argparse.Namespace) -> dict[str, Any]:
    result = vit_epoch(args.vit_batch, distributed=False, max_steps=args.vit_steps)
    return summarise_vit("plain script, 1 GPU", 1, [result], args)


def bench_vit_distributed(args: argparse.Namespace) -> dict[str, Any]:
    from air import distributed

    @distributed(num_accelerators=args.gpus, accelerator_type="CPU" if args.cpu_smoke else "GPU")
    def epoch(rank_batch: int, max_steps: int | None, sys_path: str) -> dict[str, float]:
        sys.path.insert(0, sys_path)
        return vit_epoch(rank_batch, distributed=True, max_steps=max_steps)

    results = epoch.distributed(args.vit_batch // args.gpus, args.vit_steps, str(SEED002))
    return summarise_vit(f"@distributed, {args.gpus} GPU(s) DDP", args.gpus, results, args)


def bench_vit_ray_train(args: argparse.Namespace) -> dict[str, Any]:
    from air.ray import ray_launch

    @ray_launch(num_accelerators=args.gpus, accelerator_type="CPU" if args.cpu_smoke else "GPU")
    def fit(workers: int, use_gpu: bool, rank_batch: int, max_steps: int | None, out: str) -> list[dict]:
        import ray
        import ray.train
        from ray.train import ScalingConfig
        from ray.train.torch import TorchTrainer

        def train_func(config: dict) -> None:
            import torch
            from cifar import get_dataloaders, make_vit
            from torch import nn

            loader, _ = get_dataloaders(batch_size=config["rank_batch"])
            loader = ray.train.torch.prepare_data_loader(loader)
            model = ray.train.torch.prepare_model(make_vit())
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2)
            result = _timed_epoch(model, loader, optimizer, nn.CrossEntropyLoss(), None, config["max_steps"],
                                  to_device=False)
            rank = ray.train.get_context().get_world_rank()
            Path(config["out"], f"rank_{rank}.json").write_text(json.dumps(result))

        from cifar import runtime_env

        ray.init(runtime_env=runtime_env(str(SEED002)))
        trainer = TorchTrainer(train_func, scaling_config=ScalingConfig(num_workers=workers, use_gpu=use_gpu),
                               train_loop_config={"rank_batch": rank_batch, "max_steps": max_steps, "out": out})
        trainer.fit()
        return [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank_*.json"))]

    with tempfile.TemporaryDirectory() as out:
        results = fit.distributed(args.gpus, not args.cpu_smoke, args.vit_batch // args.gpus, args.vit_steps, out)[0]
    return summarise_vit(f"Ray Train on air, {args.gpus} worker(s)", args.gpus, results, args)


def summarise_vit(how: str, gpus: int, ranks: list[dict[str, float]], args: argparse.Namespace) -> dict[str, Any]:
    """Epoch time = slowest rank; throughput = all ranks' images / that time."""
    seconds = max(r["seconds"] for r in ranks)
    images = sum(r["images"] for r in ranks)
    per_epoch = seconds * (args.vit_train_images / images) if images else float("nan")  # a cut epoch, scaled
    return {"benchmark": "seed002 ViT epoch", "how": how, "gpus": gpus, "images_timed": images,
            "seconds_per_epoch": round(per_epoch, 2), "images_per_second": round(images / seconds, 1)}


# -- seed 000: the fine-tune's tokens per second and MFU --------------------------------------------------


def bench_llm(args: argparse.Namespace) -> dict[str, Any]:
    from air.ray import ray_launch

    arch = TINY_QWEN2 if args.cpu_smoke else QWEN25_3B

    @ray_launch(num_accelerators=args.gpus, accelerator_type="CPU" if args.cpu_smoke else "GPU")
    def fit(workers: int, use_gpu: bool, arch: dict, batch: int, seq: int, steps: int, out: str) -> list[dict]:
        import ray
        import ray.train
        from ray.train import ScalingConfig
        from ray.train.torch import TorchTrainer

        def train_func(config: dict) -> None:
            import torch
            from ray.train.torch import get_device, prepare_model
            from transformers import AutoModelForCausalLM, Qwen2Config

            dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(Qwen2Config(**config["arch"]), dtype=dtype)
            model.config.use_cache = False
            params = sum(p.numel() for p in model.parameters())
            model = prepare_model(model)
            optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5)
            device = get_device()
            tokens = torch.randint(0, config["arch"]["vocab_size"], (config["batch"], config["seq"]), device=device)
            mask = torch.ones_like(tokens)
            timed, start = 0, None
            for step in range(config["steps"] + 2):  # two warm-up steps
                if step == 2:
                    if torch.cuda.is_available():
                        torch.cuda.synchronize()
                    start = time.perf_counter()
                out = model(input_ids=tokens, attention_mask=mask, labels=tokens)
                out.loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
                if step >= 2:
                    timed += tokens.numel()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            rank = ray.train.get_context().get_world_rank()
            Path(config["out"], f"rank_{rank}.json").write_text(json.dumps(
                {"seconds": seconds, "tokens": timed, "params": params,
                 "max_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0}))

        ray.init()
        trainer = TorchTrainer(train_func, scaling_config=ScalingConfig(num_workers=workers, use_gpu=use_gpu),
                               train_loop_config={"arch": arch, "batch": batch, "seq": seq, "steps": steps, "out": out})
        trainer.fit()
        return [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank_*.json"))]

    with tempfile.TemporaryDirectory() as out:
        ranks = fit.distributed(args.gpus, not args.cpu_smoke, arch, args.llm_batch, args.llm_seq, args.llm_steps,
                                out)[0]
    seconds = max(r["seconds"] for r in ranks)
    tokens = sum(r["tokens"] for r in ranks)
    params = ranks[0]["params"]
    name = gpu_name()
    peak = peak_flops(name)
    achieved = 6 * params * tokens / seconds
    return {"benchmark": "seed000 fine-tune", "how": f"Ray Train on air, {args.gpus} worker(s), DDP",
            "model": "tiny Qwen2 (smoke)" if args.cpu_smoke else "Qwen2.5-3B architecture, bf16",
            "params": params, "gpus": args.gpus, "batch_per_gpu": args.llm_batch, "seq_len": args.llm_seq,
            "tokens_per_second": round(tokens / seconds, 1),
            "model_tflops_per_gpu": round(achieved / args.gpus / 1e12, 2),
            "mfu": round(achieved / (args.gpus * peak), 4) if peak else None,
            "peak_tflops_per_gpu": peak / 1e12 if peak else None,
            "max_memory_gb": round(max(r["max_memory_gb"] for r in ranks), 1)}


# -- driver -----------------------------------------------------------------------------------------------


def prepare_vit_data(args: argparse.Namespace) -> None:
    """CIFAR-10 when CIFAR10_ROOT has it; else a generated CIFAR-shaped set of the same size (offline)."""
    from make_fake_cifar import make_fake_cifar

    root = os.environ.get("CIFAR10_ROOT")
    if root and os.path.exists(os.path.join(os.path.expanduser(root), "cifar-10-batches-py")):
        os.environ.setdefault("CIFAR10_DOWNLOAD", "0")
        return
    root = os.path.join(tempfile.gettempdir(), f"air-bench-cifar-{args.vit_train_images}")
    make_fake_cifar(root, train=args.vit_train_images, test=1000, parquet=False)
    os.environ.update({"CIFAR10_ROOT": root, "CIFAR10_DOWNLOAD": "0"})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--only", choices=["vit", "llm"], help="one of the two benchmarks")
    parser.add_argument("--gpus", type=int, help="GPUs to use (default: all of this machine's)")
    parser.add_argument("--vit-batch", type=int, default=512, help="global batch (the tutorial's 512)")
    parser.add_argument("--vit-train-images", type=int, default=50000, help="images per epoch (CIFAR-10's 50000)")
    parser.add_argument("--vit-steps", type=int, default=None, help="stop the epoch after this many steps")
    parser.add_argument("--llm-batch", type=int, default=4, help="per GPU (train.yaml's batch_size)")
    parser.add_argument("--llm-seq", type=int, default=1024, help="tokens per sequence (train_ray.py's MAX_SEQ_LEN)")
    parser.add_argument("--llm-steps", type=int, default=20)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny, on CPU: checks the script, measures nothing")
    args = parser.parse_args()

    from air.accelerators import discover

    machine = discover()
    if args.cpu_smoke:
        args.gpus = args.gpus or 2
        args.vit_batch, args.vit_train_images, args.vit_steps = 32, 256, args.vit_steps or 3
        args.llm_batch, args.llm_seq, args.llm_steps = 2, 64, 3
        os.environ.setdefault("VIT_SIZE", "tiny")
    else:
        import torch

        if not machine.gpus or not torch.cuda.is_available():
            print("bench_gpu_seeds.py measures GPU throughput, and this machine has no usable GPU "
                  f"({machine.describe()}; torch.cuda.is_available() = {torch.cuda.is_available()}).\n"
                  "Run it on a machine with NVIDIA GPUs and a CUDA build of torch, e.g. the lent device: "
                  "python benchmarks/bench_gpu_seeds.py  (or --cpu-smoke to check the script on CPU).",
                  file=sys.stderr)
            return 2
        args.gpus = args.gpus or len(machine.gpus)
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    os.environ.setdefault("TQDM_DISABLE", "1")
    results: list[dict[str, Any]] = []
    started = time.time()
    if args.only in (None, "vit"):
        prepare_vit_data(args)
        for bench in (bench_vit_plain, bench_vit_distributed, bench_vit_ray_train):
            results.append(bench(args))
            print(json.dumps(results[-1]), flush=True)
    if args.only in (None, "llm"):
        results.append(bench_llm(args))
        print(json.dumps(results[-1]), flush=True)
    report = {"gpu": gpu_name(), "gpus": args.gpus, "machine": machine.describe(), "smoke": args.cpu_smoke,
              "wall_seconds": round(time.time() - started, 1), "results": results}
    print(table(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


def table(report: dict[str, Any]) -> str:
    """Markdown rows for BENCHMARKS.md."""
    lines = [f"GPU: {report['gpu']} × {report['gpus']}" + (" (CPU SMOKE RUN: figures mean nothing)" if report["smoke"] else ""),
             "", "| benchmark | how | s/epoch | images/s | tokens/s | MFU |", "|---|---|---|---|---|---|"]
    for r in report["results"]:
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else ""
        lines.append(f"| {r['benchmark']} | {r['how']} | {r.get('seconds_per_epoch', '')} | "
                     f"{r.get('images_per_second', '')} | {r.get('tokens_per_second', '')} | {mfu} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
