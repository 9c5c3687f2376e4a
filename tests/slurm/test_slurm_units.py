"""The Slurm backend's mapping, without a cluster: shape and options → sbatch, profile vs run, the queue reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from air.accelerators import parse_accelerator_type
from air.backends import backend_for
from air.backends.slurm import SlurmBackend, SlurmOptions, batch_script, queue_reason, sbatch_argv, state_file
from air.config import Profile
from air.store.paths import RunPaths, new_run_id


def test_a_slurm_profile_gets_the_slurm_backend() -> None:
    backend = backend_for(Profile(name="hpc", backend="slurm", partition="debug"))
    assert isinstance(backend, SlurmBackend) and backend.name == "slurm" and backend.partition == "debug"


def test_shape_and_options_become_sbatch_options(tmp_path: Path) -> None:
    profile = Profile(name="hpc", backend="slurm", partition="debug", account="lab", qos="low", time_limit=30)
    options = SlurmOptions.from_profile(profile, {"qos": "high", "mem": "64G", "nodelist": "n[1-2]"})
    gpu = sbatch_argv("r1", tmp_path, parse_accelerator_type("GPU_8xH100"), 2, options, "air-run-r1")
    assert {"--nodes=2", "--ntasks-per-node=1", "--gres=gpu:8", "--partition=debug", "--account=lab",
            "--qos=high", "--time=30", "--mem=64G", "--nodelist=n[1-2]", "--job-name=air-run-r1"} <= set(gpu)
    assert not any(a.startswith("--cpus-per-task") for a in gpu)
    cpu = sbatch_argv("r1", tmp_path, parse_accelerator_type("CPU_4xCPU"), 1, SlurmOptions.from_profile(profile), "t")
    assert "--cpus-per-task=4" in cpu and not any(a.startswith("--gres") for a in cpu)
    script = batch_script(tmp_path, 2)
    assert "srun --nodes=2 --ntasks=2 --ntasks-per-node=1" in script and "-m air.backends.slurm_node" in script


def test_queue_reason_is_slurms(air_home: Path) -> None:
    run_id = new_run_id()
    RunPaths(run_id).folder.mkdir(parents=True)
    assert "being submitted" in queue_reason(run_id, "hpc")
    state_file(run_id).write_text(json.dumps({"job_id": "12", "state": "PENDING", "reason": "Priority",
                                                 "partition": "debug"}))
    assert queue_reason(run_id, "hpc") == "Slurm job 12 PENDING (Priority) in partition debug"


def test_a_walled_server_refuses_a_slurm_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under `air server`'s walls a Slurm job would be submitted as the server's account: refused, saying so."""
    from air.errors import UserInputError
    from air.settings import AIR_ISOLATION

    monkeypatch.setenv(AIR_ISOLATION, "unix-user+bwrap")
    with pytest.raises(UserInputError, match="does not offer yet") as refused:
        backend_for(Profile(name="hpc", backend="slurm", partition="debug"))
    assert refused.value.hint and "login node" in refused.value.hint
