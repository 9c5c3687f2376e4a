"""The Slurm backend's mapping, without a cluster: shape and options → sbatch, profile vs run, the queue reason."""

from __future__ import annotations

import json
import os
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


def test_a_walled_server_offers_a_slurm_profile_only_with_its_shared_folders(monkeypatch: pytest.MonkeyPatch,
                                                                            tmp_path: Path) -> None:
    """Under `air server`'s walls each job is submitted as the run's account, in a folder of its own under the
    profile's work_root, its nodes on the profile's node_python: without them, or with a work_root others
    may write, the profile is refused, saying what to set; with them it is offered."""
    from air.errors import UserInputError
    from air.settings import AIR_ISOLATION

    monkeypatch.setenv(AIR_ISOLATION, "unix-user+bwrap")
    with pytest.raises(UserInputError, match="work_root") as refused:
        backend_for(Profile(name="hpc", backend="slurm", partition="debug"))
    assert refused.value.hint and "node_python" in refused.value.hint and "docs/slurm.md" in refused.value.hint
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o777)
    with pytest.raises(UserInputError, match="no one else may write"):
        backend_for(Profile(name="hpc", backend="slurm", work_root=str(loose), node_python="/usr/bin/python3"))
    own = tmp_path / "own"
    own.mkdir(mode=0o711)
    backend = backend_for(Profile(name="hpc", backend="slurm", work_root=str(own), node_python="/usr/bin/python3"))
    assert isinstance(backend, SlurmBackend)


def test_a_walled_jobs_node_logs_are_copied_only_from_the_accounts_own_files(tmp_path: Path) -> None:
    """The supervisor (root) copies a walled job's node logs from the job folder, which the run's account
    fills: a log that is a link (to a file only root may read), a hard link to another account's file, or
    another account's file is never read; the account's own log is copied, with its time marks."""
    import os

    from air.backends.slurm import _LogCopier
    from air.launcher.pump import times_path

    account, other = 40123, 40124
    secret = tmp_path / "root-only.txt"
    secret.write_text("root-only-marker\n")
    secret.chmod(0o600)
    alices = tmp_path / "alice.log"
    alices.write_text("alice-marker\n")
    os.chown(alices, other, other)
    job = tmp_path / "job"
    job.mkdir()
    (job / "soft.log").symlink_to(secret)
    os.link(alices, job / "hard.log")
    foreign = job / "foreign.log"
    foreign.write_text("foreign-marker\n")
    os.chown(foreign, other, other)
    own = job / "own.log"
    own.write_text("own line\n")
    os.chown(own, account, account)
    copies = [(job / name, tmp_path / f"run-{name}") for name in ("soft.log", "hard.log", "foreign.log", "own.log")]
    copier = _LogCopier(copies, account)
    copier.start()
    with open(own, "a") as fh:
        fh.write("own second line\n")
    copier.stop()
    assert not any((tmp_path / f"run-{name}").exists() for name in ("soft.log", "hard.log", "foreign.log"))
    assert (tmp_path / "run-own.log").read_text() == "own line\nown second line\n"
    assert Path(times_path(tmp_path / "run-own.log")).read_text().startswith("0 ")


def test_a_controller_away_past_its_bound_ends_the_attempt_as_lost(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A started job whose controller stops answering is waited for (its nodes' own reports would end it),
    but not for ever: past CONTROLLER_AWAY_MAX_S with no node's end reported (the cluster is gone) the attempt
    ends, its job taken as lost and said so in the node logs. Slurm's tools here answer as they do with
    slurmctld away."""
    import stat

    import air.backends.slurm as slurm
    from air.backends.slurm import SlurmAttempt

    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("squeue", "sacct", "scancel"):
        script = tools / tool
        script.write_text("#!/bin/sh\necho 'slurm_load_jobs error: Unable to contact slurm controller "
                          "(connect failure)' >&2\nexit 1\n")
        script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tools}:{os.environ['PATH']}")
    monkeypatch.setattr(slurm, "CONTROLLER_AWAY_MAX_S", 1.5)
    job = tmp_path / "job"
    (job / "node_0").mkdir(parents=True)
    log = tmp_path / "node_0.log"
    attempt = SlurmAttempt("7", job, [0], ["127.0.0.1"], ["n1"])
    attempt.log_paths = [str(log)]
    outcome = attempt.wait(timeout_s=None, should_stop=lambda: False)
    assert outcome.lost_node and "has not answered for 1.5 s" in outcome.lost_node, outcome
    assert "taken as lost" in log.read_text()
    assert (job / "stop").exists()  # the nodes were asked to end theirs


def test_a_node_report_nested_past_the_bounds_is_no_report(tmp_path: Path) -> None:
    """What a walled job's account writes in its job folder is read by the server's supervisor: an exits.json
    nested 200,000 deep (or a link to a root-only file) is no report, never a crash of the supervisor."""
    from air.backends.slurm import SlurmAttempt, read_node_json

    job = tmp_path / "job"
    (job / "node_0").mkdir(parents=True)
    deep = job / "node_0" / "exits.json"
    deep.write_text("[" * 200_000 + "]" * 200_000)
    assert read_node_json(deep, None) is None
    assert SlurmAttempt("7", job, [0], ["127.0.0.1"], ["n1"])._read_exits(0) is None
    secret = tmp_path / "root-only.json"
    secret.write_text('{"addr": "secret"}')
    (job / "node_0" / "host.json").symlink_to(secret)
    assert read_node_json(job / "node_0" / "host.json", None) is None
