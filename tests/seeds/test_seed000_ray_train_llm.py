"""Seed 000 as a user runs it: `air run -f train_cpu.yaml --watch` on 2 CPU nodes of this machine, a Ray
cluster started by the workload's own command, Ray Train fine-tuning a tiny Qwen2 offline."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from seed_helpers import SEED000, air_cli, losses, processes_with_env, run, tail

from proc_helpers import mlflow_run_ended


def command_lines(path: Path) -> list[str]:
    import yaml

    return yaml.safe_load(path.read_text())["command"].splitlines()


#: train_cpu.yaml's node flags in place of the document's `--num-gpus="$GPUS_PER_NODE"` (no GPU in CI).
CPU_FLAGS = "--num-cpus=$LOCAL_WORLD_SIZE --num-gpus=0 --object-store-memory=100000000"


def test_cpu_yaml_runs_the_gpu_yaml_command_after_its_offline_prelude() -> None:
    """The CI variant must keep testing the document's command: only the prelude and the devices differ.
    Both are the document's own Ray commands (port 6379, `ray stop`), which air's `ray` shim makes safe."""
    def ray_part(lines: list[str]) -> list[str]:
        lines = lines[lines.index("RAY_HEAD_PORT=6379"):]
        return [line for line in lines if not line.strip().startswith("#")]

    gpu, cpu = command_lines(SEED000 / "train.yaml"), command_lines(SEED000 / "train_cpu.yaml")
    as_cpu = [line.replace('--num-gpus="$GPUS_PER_NODE"', CPU_FLAGS).replace("GPU(s)", "CPU(s)")
              for line in ray_part(gpu)]
    assert ray_part(cpu) == as_cpu, "train_cpu.yaml's Ray part drifted from train.yaml's"
    assert "ray stop" in [line.strip() for line in gpu]
    assert not (SEED000 / "ray_node_args.py").exists()


def test_gpu_yaml_is_valid_for_an_8_gpu_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIR_FAKE_GPUS", "8:H100")
    result = air_cli("run", "-f", str(SEED000 / "train.yaml"), "--dry-run")
    assert result.returncode == 0, result.stdout
    assert "DRY_RUN_OK" in result.stdout and "GPU_8xH100" in result.stdout


def test_offline_assets_load_with_the_scripts_own_calls(tmp_path: Path) -> None:
    """make_tiny_assets.py builds what AutoTokenizer/AutoModelForCausalLM/load_dataset read, twice alike."""
    code = (
        "import sys, torch; sys.path.insert(0, '.');"
        "from make_tiny_assets import build_assets, read_jsonl, instruction_rows, SHIPPED_DATA;"
        f"out = build_assets(__import__('pathlib').Path({str(tmp_path / 'a')!r}));"
        "from transformers import AutoModelForCausalLM, AutoTokenizer; from datasets import load_dataset;"
        "tok = AutoTokenizer.from_pretrained(out / 'tiny-qwen2');"
        "model = AutoModelForCausalLM.from_pretrained(out / 'tiny-qwen2', dtype=torch.float32);"
        "data = load_dataset('json', data_files=str(out / 'instructions.jsonl'), split='train');"
        "assert model.config.model_type == 'qwen2' and tok.eos_token == '<|endoftext|>';"
        "assert len(data) == 96 and read_jsonl(SHIPPED_DATA) == instruction_rows();"
        "print('ok', model.num_parameters(), len(tok))"
    )
    checked = run([sys.executable, "-c", code], cwd=SEED000, env={"HF_HOME": str(tmp_path / "hf")}, timeout=180)
    assert checked.returncode == 0 and "ok" in checked.stdout, tail(checked.stdout)


@pytest.mark.ray
@pytest.mark.timeout(900)  # two attempts of a Ray cluster on 2 busy cores
def test_a_failed_attempt_resumes_from_its_last_checkpoint_and_the_run_trains_to_the_end(
        air_home: Path, tmp_path: Path) -> None:
    """The seed's one end-to-end run (a clean run of this workload is the Slurm test's, tests/slurm): the
    fine-tune checkpoints at step 6 (checkpoint_every: 6) into AIR_CHECKPOINT_DIR and attempt 0 fails at
    step 8 (crash_at_step); attempt 1 resumes from step 6 through `ray.train.get_checkpoint()` and trains to
    step 12. `--watch` shows the loss fall over the whole run, each attempt is its own MLflow run with its
    own steps, and nothing of either attempt's Ray cluster is left."""
    from mlflow import MlflowClient

    from air.store.paths import RunPaths
    from air.store.run_store import RunStore

    result = air_cli("run", "-f", str(SEED000 / "train_cpu.yaml"), "--watch", "--json",
                     "--override", "max_retries=1", "--override", "parameters.crash_at_step=8",
                     env={"HF_HOME": str(tmp_path / "hf")}, timeout=900)
    events = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert result.returncode == 0, tail(result.stdout, 120)
    assert events[-1]["type"] == "TERMINAL" and events[-1]["status"] == "SUCCESS", tail(result.stdout, 120)
    run_id = events[0]["run_id"]
    paths = RunPaths(run_id)
    first, second = paths.node_log(0, 0).read_text(), paths.node_log(1, 0).read_text()
    assert "simulated failure at step 8" in first and "step 8: loss" not in first, first[-3000:]
    assert "resumed from the checkpoint of step 6" in second, second[-3000:]
    resumed = losses(second.splitlines())
    assert len(resumed) == 6, second[-3000:]  # steps 7..12 only
    assert (paths.checkpoints() / f"qwen-sft-{run_id}").is_dir()

    log = [e["line"] for e in events if e.get("type") == "LOG"]
    seen = losses(log)  # both attempts, each step once
    assert len(seen) == 12, "\n".join(log[-40:])
    assert seen[-1] < seen[0] * 0.9, seen  # the loss falls, as --watch shows
    assert any("Ray cluster ready" in line for line in log)

    client = MlflowClient(f"sqlite:///{air_home / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("air-ray-train-distributed-cpu")
    attempts = RunStore().list_attempts(run_id)
    assert [a.index for a in attempts] == [0, 1]
    ended = [mlflow_run_ended(client, str(a.mlflow_run_id), air_run_id=run_id) for a in attempts]
    assert {r.info.run_id for r in client.search_runs([experiment.experiment_id])} == {r.info.run_id for r in ended}
    assert [r.info.status for r in ended] == ["FAILED", "FINISHED"]
    histories = [client.get_metric_history(r.info.run_id, "train_loss") for r in ended]
    assert [m.step for m in histories[0]] == list(range(1, 8))
    assert [m.step for m in histories[1]] == list(range(7, 13))
    assert histories[1][-1].value < histories[0][0].value
    # Nothing of the run's Ray clusters is left: `ray stop` (air's shim) ended each attempt's head, and the
    # joining node's `ray start --block` ended itself once the head was gone.
    assert not processes_with_env("AIR_RUN_ID", lambda v: v == run_id)
    assert not Path(f"/tmp/air-seed000-{run_id}").exists()
