"""Ranks see what torchrun's workers see (issue 27): frameworks that ask "was I launched by torchrun?"
(`torch.distributed.is_torchelastic_launched()`, Lightning's TorchElasticEnvironment, accelerate) take an
air rank for a torchrun worker and give their own errors, and OMP_NUM_THREADS is 1 when unset, as torchrun
sets it. The reference is a real `torchrun` run on the same script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from air import distributed
from air.distributed.ranks import omp_note
from air.store.run_store import RunStore

#: What torchrun's agent sets for its own bookkeeping, not the worker's contract: the signals it forwards.
AGENT_ONLY = {"TORCHELASTIC_SIGNALS_TO_HANDLE"}
#: Values that name a particular launch (ports, ids, who hosts the store, each worker's own error file):
#: compared by presence only.
PER_LAUNCH = {"MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
              "TORCHELASTIC_ERROR_FILE"}
#: torchrun's own warning when it sets OMP_NUM_THREADS=1 for its workers (torch/distributed/run.py).
TORCHRUN_OMP_WARNING = ("Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to "
                        "avoid your system being overloaded, please further tune the variable for optimal "
                        "performance in your application as needed.")

#: What a torchrun worker writes, to a file of its own (two workers' lines on one shared stdout can interleave):
#: every variable its agent added to the environment torchrun was given.
ENV_SCRIPT = """
import json, os, sys
from pathlib import Path
import torch
given = set(json.loads(os.environ["P27E_GIVEN"])) | {"P27E_GIVEN", "P27E_OUT"}
(Path(os.environ["P27E_OUT"]) / (os.environ["RANK"] + ".json")).write_text(json.dumps({
    "env": {k: v for k, v in os.environ.items() if k not in given},
    "threads": torch.get_num_threads(),
    "elastic": torch.distributed.is_torchelastic_launched()}))
"""


def env_of_rank(keys: list[str] | None) -> dict[str, Any]:
    """In a rank: its environment (`keys` of it, or all), torch's thread count, and torch's own verdict."""
    import os

    import torch

    return {"env": {k: v for k, v in os.environ.items() if keys is None or k in keys},
            "threads": torch.get_num_threads(), "elastic": torch.distributed.is_torchelastic_launched()}


def run_torchrun(tmp_path: Path) -> list[dict[str, Any]]:
    """What each of `torchrun --standalone --nproc-per-node=2`'s workers sees, OMP_NUM_THREADS unset."""
    script = tmp_path / "env_script.py"
    script.write_text(ENV_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["P27E_GIVEN"] = json.dumps(sorted(env))
    out = tmp_path / "workers"
    out.mkdir()
    env["P27E_OUT"] = str(out)
    torchrun = Path(sys.executable).with_name("torchrun")
    done = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node=2", str(script)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert TORCHRUN_OMP_WARNING in done.stderr  # torchrun sets OMP_NUM_THREADS=1 itself (and warns of it)
    return [json.loads(path.read_text()) for path in sorted(out.glob("*.json"))]


def test_a_local_rank_sees_what_a_torchrun_worker_sees(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capfd: pytest.CaptureFixture[str]) -> None:
    reference = sorted(run_torchrun(tmp_path), key=lambda r: int(r["env"]["RANK"]))
    assert len(reference) == 2
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    capfd.readouterr()
    ranks = distributed(num_accelerators=2, accelerator_type="CPU")(env_of_rank).distributed(None)
    assert capfd.readouterr().err.count(omp_note(2)) == 1  # air's own note, said once to the caller
    run = RunStore().list_runs(statuses="all", limit=1)[0]
    for ours, theirs in zip(ranks, reference, strict=True):
        assert ours["elastic"] is True and theirs["elastic"] is True
        missing = set(theirs["env"]) - set(ours["env"]) - AGENT_ONLY
        assert not missing, f"torchrun sets {sorted(missing)}, air does not"
        same = {k: v for k, v in theirs["env"].items() if k not in PER_LAUNCH | AGENT_ONLY}
        assert {k: ours["env"][k] for k in same} == same
        assert ours["threads"] == theirs["threads"] == 1
        assert ours["env"]["TORCHELASTIC_RUN_ID"] == run.id  # the run air lists, as torchrun's is its job id
    # Each rank its own error file, as each torchrun worker has (torch's @record writes the root cause there).
    files = [r["env"]["TORCHELASTIC_ERROR_FILE"] for r in ranks]
    assert len(set(files)) == 2 and all(f.endswith(".json") and "@AIR" not in f for f in files), files


def test_omp_num_threads_the_caller_set_is_kept(monkeypatch: pytest.MonkeyPatch,
                                                capfd: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    capfd.readouterr()
    ranks = distributed(num_accelerators=2, accelerator_type="CPU")(env_of_rank).distributed(["OMP_NUM_THREADS"])
    assert [r["env"]["OMP_NUM_THREADS"] for r in ranks] == ["2", "2"]
    assert [r["threads"] for r in ranks] == [2, 2]
    assert "OMP_NUM_THREADS=1" not in capfd.readouterr().err


def test_a_single_rank_is_not_given_omp_num_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun sets it only with more than one process per node; so does air."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    [rank] = distributed(num_accelerators=1, accelerator_type="CPU")(env_of_rank).distributed(["OMP_NUM_THREADS"])
    assert rank["env"] == {} and rank["elastic"] is True


def test_remote_ranks_name_their_run_attempt_and_node_group() -> None:
    """Two local nodes of one rank each: GROUP_* is the node, ROLE_* the world, the run id is air's."""
    keys = ["RANK", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME",
            "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS"]
    call = distributed(num_accelerators=2, accelerator_type="CPU_1xCPU", remote=True)(env_of_rank)
    ranks = call.distributed(keys)
    run = RunStore().list_runs(statuses="all", limit=1)[0]
    assert [r["env"] for r in ranks] == [
        {"RANK": str(r), "GROUP_RANK": str(r), "GROUP_WORLD_SIZE": "2", "ROLE_RANK": str(r), "ROLE_WORLD_SIZE": "2",
         "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": run.id,
         "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0"} for r in range(2)]
    assert all(r["elastic"] for r in ranks)


def lightning_in_a_rank(devices: int) -> dict[str, Any]:
    """A two-step Lightning DDP fit: which cluster environment Lightning picked, and its error if any."""
    import warnings

    import pytorch_lightning as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    warnings.filterwarnings("ignore")

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = pl.Trainer(strategy="ddp", accelerator="cpu", devices=devices, max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    environment = type(trainer.strategy.cluster_environment).__name__
    data = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=4)
    try:
        trainer.fit(Tiny(), data)
    except Exception as exc:  # the error is what the test looks at
        return {"environment": environment, "error": f"{type(exc).__name__}: {exc}"}
    return {"environment": environment, "error": None, "steps": trainer.global_step,
            "world": trainer.world_size}


def test_lightning_ddp_takes_an_air_rank_for_torchrun_and_says_its_own_error_on_a_devices_mismatch() -> None:
    call = distributed(num_accelerators=2, accelerator_type="CPU_2xCPU")(lightning_in_a_rank)
    fitted = call.distributed(2)
    assert fitted == [{"environment": "TorchElasticEnvironment", "error": None, "steps": 2, "world": 2}] * 2
    wrong = call.distributed(3)
    assert [r["environment"] for r in wrong] == ["TorchElasticEnvironment"] * 2
    for rank in wrong:
        assert rank["error"] == ("ValueError: You set `devices=3` and `num_nodes=1` in Lightning, but the product "
                                 "(3 * 1) does not match the world size (2).")
