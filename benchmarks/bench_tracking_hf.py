"""A 2-rank Hugging Face `Trainer` call with tracking on vs off (issue 24: a look at MLflow costs nothing).

transformers (and accelerate) call `importlib.util.find_spec("mlflow")` to see whether MLflow is installed.
air used to take that look for use, make the call's MLflow run and hold the rank until it existed. Each
sample is a fresh `python` process making one `@distributed` call whose ranks build a tiny GPT-2 from a
config (no hub), train it with `Trainer` for a few steps on random tokens over gloo, and return the loss.
Samples alternate tracking on / off; prints the medians of the call's wall time and their difference.

    .venv/bin/python benchmarks/bench_tracking_hf.py [--repeat 3]

Needs transformers and accelerate (Trainer requires accelerate).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

DRIVER = f"""
import sys, time
sys.path.insert(0, {str(HERE)!r})
from air import distributed
import bench_tracking_hf
call = distributed(num_accelerators=2, accelerator_type="CPU")(bench_tracking_hf.train)
start = time.perf_counter()
losses = call.distributed()
print("CALL_S", time.perf_counter() - start, losses)
"""


def train() -> float:
    """One rank: a tiny GPT-2 made here, 4 Trainer steps of random tokens, DDP over gloo."""
    import tempfile

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=2))
    tokens = torch.randint(0, 64, (32, 16))
    data = [{"input_ids": row, "labels": row} for row in tokens]
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=4, max_steps=4, use_cpu=True,
                                 logging_steps=1, save_strategy="no", disable_tqdm=True)
        result = Trainer(model=model, args=args, train_dataset=data).train()
    return float(result.training_loss)


def settle() -> None:
    """Wait for air's detached recorder of the last tracked call (off the caller's path, not counted)."""
    import psutil

    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if not [p for p in psutil.process_iter(["cmdline"])
                if "air.distributed.tracked" in " ".join(p.info["cmdline"] or [])]:
            return
        time.sleep(0.2)


def sample(env: dict[str, str]) -> float:
    out = subprocess.run([sys.executable, "-c", DRIVER], env=env, capture_output=True, text=True, timeout=600)
    line = next((x for x in out.stdout.splitlines() if x.startswith("CALL_S")), None)
    if out.returncode != 0 or line is None:
        raise SystemExit(f"the call failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return float(line.split()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    opts = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="air-bench-tracking-hf-"))
    base = {**os.environ, "AIR_HOME": str(home), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "AIR_TRACKING"):
        base.pop(name, None)
    # The store's schema first, and one untimed call of each so files are in the page cache.
    subprocess.run([sys.executable, "-c", "from air.tracking import prepare_store, tracking_uri; "
                    "prepare_store(tracking_uri())"], env=base, check=True, timeout=600)
    modes = {"tracking on": base, "tracking off": {**base, "AIR_TRACKING": "off"}}
    for env in modes.values():
        sample(env)
        settle()
    times: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(opts.repeat):
        for name, env in modes.items():
            times[name].append(sample(env))
            settle()
    print(f"# {platform.node()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; repeat {opts.repeat}")
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, values in times.items():
        print(f"{name:13s} median {medians[name]:6.2f} s   samples " + " ".join(f"{v:.2f}" for v in values))
    print(f"on - off: {medians['tracking on'] - medians['tracking off']:+.2f} s (target: within 0.3 s)")
    asked = len(list(home.glob("runs/*/attempt_*/mlflow_request")))
    print(f"tracked calls whose ranks asked for an MLflow run (held a rank for it): {asked} of {opts.repeat + 1}")


if __name__ == "__main__":
    main()
