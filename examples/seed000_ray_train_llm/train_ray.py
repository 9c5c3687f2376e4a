#!/usr/bin/env python3
"""Distributed data-parallel fine-tuning with Ray Train on a single 8x H100 node.

The workload `command` starts a Ray head with 8 GPUs and runs this script. Ray Train's
TorchTrainer launches one worker per GPU (8 total), wraps the model in DDP, shards
the dataset across workers, and aggregates metrics. Each worker runs `train_func`.

Uses a public model (no Hugging Face token required) so the example runs as-is.

Changes for a self-hosted run (everything else is the document's script):
- model, data set and the training settings come from the workload's `parameters:`
  (HYPERPARAMETERS_PATH) or the environment (MODEL_NAME, DATASET_NAME, …); the defaults are the
  document's. MODEL_NAME may be a folder and DATASET_NAME a JSON-lines file, for offline runs
  (`make_tiny_assets.py` builds a tiny Qwen2 and ships a small instruction set);
- without GPUs (a CPU node shape) it runs one CPU worker per slot (WORLD_SIZE), with gloo;
- with several nodes it waits until they have all joined before sizing the trainer;
- the Ray Train run folder is per run (RAY_STORAGE_PATH, AIR_RUN_ID), so runs on one machine never share it;
- under air it is the run's checkpoint folder (AIR_CHECKPOINT_DIR), the same in every attempt: rank 0
  checkpoints every `checkpoint_every` steps and a retried attempt resumes from the last checkpoint
  (`ray.train.get_checkpoint()`) instead of step 0.
"""

import os
import tempfile
import time

import mlflow
import ray
import ray.train
import torch
from datasets import load_dataset
from ray.train import Checkpoint, CheckpointConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer, prepare_data_loader, prepare_model
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer

DEFAULTS = {
    "model_name": "Qwen/Qwen2.5-3B",
    "dataset_name": "tatsu-lab/alpaca",
    "dataset_split": "train[:8000]",
    "max_seq_len": 1024,
    "dtype": "bfloat16",
    "lr": 2e-5,
    "batch_size": 4,
    "max_steps": 100,
    "checkpoint_every": 50,  # steps between checkpoints (0: none); a retried attempt resumes from the last
    "crash_at_step": 0,  # to try resuming: the first attempt (AIR_ATTEMPT=0) fails at this step (0: never)
}


def settings() -> dict:
    """The document's constants, overridable by the workload's parameters, then by the environment."""
    values = dict(DEFAULTS)
    path = os.environ.get("HYPERPARAMETERS_PATH")
    if path and os.path.exists(path):
        import yaml

        with open(path) as fh:
            values.update({k: v for k, v in (yaml.safe_load(fh) or {}).items() if k in DEFAULTS})
    for key, default in DEFAULTS.items():
        if os.environ.get(key.upper()):
            values[key] = type(default)(os.environ[key.upper()])
    return values


SETTINGS = settings()
MODEL_NAME = SETTINGS["model_name"]
DATASET_NAME = SETTINGS["dataset_name"]
MAX_SEQ_LEN = int(SETTINGS["max_seq_len"])


def load_instructions(name: str, split: str):
    """`load_dataset` of a Hub data set, or of a local JSON-lines file in the same (Alpaca) format."""
    if name.endswith((".json", ".jsonl")):
        return load_dataset("json", data_files=name, split=split)
    return load_dataset(name, split=split)


def build_dataset(tokenizer):
    raw = load_instructions(DATASET_NAME, SETTINGS["dataset_split"])

    def format_example(row):
        prompt = f"### Instruction:\n{row['instruction']}\n\n"
        if row.get("input"):
            prompt += f"### Input:\n{row['input']}\n\n"
        text = f"{prompt}### Response:\n{row['output']}{tokenizer.eos_token}"
        out = tokenizer(text, truncation=True, max_length=MAX_SEQ_LEN, padding="max_length")
        out["labels"] = out["input_ids"].copy()
        return out

    return raw.map(format_example, remove_columns=raw.column_names)


def train_func(config: dict):
    """Runs on every Ray Train worker (one per GPU)."""
    rank = ray.train.get_context().get_world_rank()

    tokenizer = AutoTokenizer.from_pretrained(MODEL_NAME)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    # `dtype` is transformers' current spelling of the document's `torch_dtype`.
    model = AutoModelForCausalLM.from_pretrained(MODEL_NAME, dtype=getattr(torch, config["dtype"]))
    model.config.use_cache = False
    # A retried attempt (air: AIR_RESUMED=1) finds the last checkpoint of the attempt before it.
    step, resumed = 0, None
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            resumed = torch.load(os.path.join(folder, "state.pt"), map_location="cpu", weights_only=True)
        model.load_state_dict(resumed["model"])
        step = int(resumed["step"])
        if rank == 0:
            print(f"resumed from the checkpoint of step {step}", flush=True)
    # prepare_model moves the model to this worker's GPU and wraps it in DDP.
    model = prepare_model(model)

    dataset = build_dataset(tokenizer).with_format("torch")
    loader = DataLoader(dataset, batch_size=config["batch_size"], shuffle=True, drop_last=True)
    # prepare_data_loader injects a DistributedSampler and moves batches to the GPU.
    loader = prepare_data_loader(loader)

    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"])
    if resumed is not None:
        optimizer.load_state_dict(resumed["optimizer"])

    # air exports MLFLOW_RUN_ID and MLFLOW_TRACKING_URI to every node of the run (Ray's workers inherit
    # them from `ray start`), so logging needs no set-up. Gate on MLFLOW_RUN_ID so the script also runs
    # cleanly outside air, where it is unset.
    use_mlflow = rank == 0 and bool(os.environ.get("MLFLOW_RUN_ID"))
    if use_mlflow:
        mlflow.start_run(run_id=os.environ.get("MLFLOW_RUN_ID"))
        mlflow.log_params({"model": MODEL_NAME, "lr": config["lr"], "batch_size": config["batch_size"]})

    model.train()
    epoch = 0
    while step < config["max_steps"]:  # the document stops within its first epoch; small data sets need more
        if ray.train.get_context().get_world_size() > 1:
            loader.sampler.set_epoch(epoch)
        epoch += 1
        for batch in loader:
            out = model(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                labels=batch["labels"],
            )
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step == config.get("crash_at_step") and config.get("attempt") == 0:
                raise RuntimeError(f"crash_at_step: a simulated failure at step {step} (attempt 0 only)")

            metrics = {"loss": out.loss.item(), "step": step}
            every = int(config.get("checkpoint_every") or 0)
            if every and step % every == 0 and rank == 0:
                with tempfile.TemporaryDirectory() as folder:
                    torch.save({"model": getattr(model, "module", model).state_dict(),
                                "optimizer": optimizer.state_dict(), "step": step},
                               os.path.join(folder, "state.pt"))
                    ray.train.report(metrics, checkpoint=Checkpoint.from_directory(folder))
            else:
                ray.train.report(metrics)
            if use_mlflow:
                mlflow.log_metric("train_loss", out.loss.item(), step=step)
            if rank == 0:
                print(f"step {step}: loss {out.loss.item():.4f}", flush=True)
            if step >= config["max_steps"]:
                break

    if use_mlflow:
        mlflow.end_run()


def wait_for_nodes(expected: int, timeout_s: float = 300.0) -> None:
    """Multi-node: the other nodes join the head while this driver starts; size the trainer after."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = sum(1 for node in ray.nodes() if node.get("Alive"))
        if alive >= expected:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {alive} of {expected} Ray nodes joined within {timeout_s:g} s")
        time.sleep(1.0)


def main():
    ray.init(address="auto")
    wait_for_nodes(int(os.environ.get("NUM_NODES", "1")))
    total_gpus = int(ray.cluster_resources().get("GPU", 0))
    print(f"Ray cluster ready: {total_gpus} GPU(s)", flush=True)
    # No GPU (a CPU node shape): one CPU worker per slot of the allocation, gloo instead of NCCL.
    num_workers = total_gpus or int(os.environ.get("WORLD_SIZE", "1"))

    config = {key: SETTINGS[key] for key in ("lr", "batch_size", "max_steps", "dtype", "checkpoint_every",
                                             "crash_at_step")}
    config["attempt"] = int(os.environ.get("AIR_ATTEMPT", "0"))
    trainer = TorchTrainer(
        train_func,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=total_gpus > 0),
        run_config=RunConfig(
            # air: the run's checkpoint folder, kept across attempts (a shared path or URI on a cluster).
            storage_path=os.environ.get("AIR_CHECKPOINT_DIR") or os.environ.get("RAY_STORAGE_PATH", "/tmp/ray_results"),
            name="qwen-sft" + (f"-{os.environ['AIR_RUN_ID']}" if os.environ.get("AIR_RUN_ID") else ""),
            checkpoint_config=CheckpointConfig(num_to_keep=1),
        ),
    )
    result = trainer.fit()
    print(f"Training finished. Final metrics: {result.metrics}", flush=True)

    ray.shutdown()


if __name__ == "__main__":
    main()
