"""Workloads on a real 2-node Slurm cluster (issue 37): each attempt is one Slurm job of N nodes."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from slurm_cluster import SlurmCluster, processes_of

from air.backends.slurm import read_state
from air.store.paths import RunPaths
from air.store.run_store import RunStore

#: Every test here waits on real processes on 2 busy cores: minutes, not the suite's default 300 s.
pytestmark = pytest.mark.timeout(900)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "workloads" / "torchrun_ddp" / "workload.yaml"


def air(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "air.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout)


def workload(folder: Path, command: str, extra: str = "", retries: int = 0) -> Path:
    path = folder / "w.yaml"
    body = (f"experiment_name: slurm-test\ncompute: {{num_accelerators: 2, accelerator_type: CPU_1xCPU}}\n"
            f"max_retries: {retries}\n{extra}command: |\n")
    path.write_text(body + "".join(f"  {line}\n" for line in command.splitlines()))
    return path


def submit(path: Path) -> str:
    result = air("run", "-f", str(path), "--json")
    assert result.returncode == 0, result.stderr + result.stdout
    import json

    return str(json.loads(result.stdout)["data"]["run_id"])


def wait_for(check, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout} s: {what}")


def no_leftover(cluster: SlurmCluster, timeout: float = 30) -> None:
    """No process of any run is left: none names the cluster's slurm.conf but its own daemons, and no job."""
    def clean() -> bool:
        left = [p for p in processes_of(cluster.conf) if int(p.split(":")[0]) not in cluster.pids]
        jobs = cluster.tool("squeue", "-h", "-t", "PENDING,RUNNING,COMPLETING,CONFIGURING", "-o", "%i").stdout.split()
        return not left and not jobs

    try:
        wait_for(clean, timeout, "no process or job left")
    except AssertionError:
        left = [p for p in processes_of(cluster.conf) if int(p.split(":")[0]) not in cluster.pids]
        raise AssertionError(f"left: {left}; {cluster.tool('squeue').stdout}") from None


@pytest.mark.timeout(900)  # minutes on 2 busy cores (torch's import, Slurm's time limit)
def test_two_node_ddp_example_succeeds_with_both_nodes_logs(hpc: SlurmCluster) -> None:
    result = air("run", "-f", str(EXAMPLE), "--watch", timeout=300)
    assert result.returncode == 0, result.stderr + result.stdout
    assert "epoch 2: loss" in result.stdout
    run = RunStore().list_runs(statuses="all")[0]
    assert run.status.value == "SUCCESS" and run.num_nodes == 2 and run.backend == "slurm"
    logs = RunPaths(run.id).node_logs(run.current_attempt)
    assert sorted(logs) == [0, 1]
    assert "epoch 0: loss" in logs[0].read_text()
    assert logs[1].exists()  # (rank 1 prints nothing: train.py logs on rank 0)
    state = read_state(run.id)
    assert state is not None and state["job_id"]
    def job() -> list[str]:
        return hpc.tool("squeue", "-h", "-t", "all", "-j", str(state["job_id"]), "-o", "%T %D").stdout.split()

    # One job of 2 nodes, ended by itself. The run is SUCCESS once both nodes' commands have succeeded; the
    # batch script may still be ending then (RUNNING, under load: a CI run of 099a9ac saw it), and Slurm's
    # COMPLETING (its accounting's last look) may follow: the job's final state is read once it has one.
    wait_for(lambda: job()[:1] not in (["RUNNING"], ["COMPLETING"]), 60, "Slurm to end the job")
    assert job() == ["COMPLETED", "2"], job()
    no_leftover(hpc)


def test_queued_behind_a_full_cluster_shows_slurms_reason_then_cancel(hpc: SlurmCluster, tmp_path: Path) -> None:
    blocker = hpc.tool("sbatch", "--parsable", "-N2", "--wrap", "sleep 600").stdout.strip()
    try:
        run_id = submit(workload(tmp_path, "echo never"))

        def pending() -> bool:
            return "PENDING (Resources)" in air("list", "runs").stdout

        wait_for(pending, 180, "the run's row says Slurm's PENDING reason")
        shown = air("list", "runs").stdout
        assert "QUEUED" in shown and "Slurm job" in shown and "PENDING (Resources)" in shown, shown
        state = read_state(run_id)
        assert state is not None and state["state"] == "PENDING" and state["reason"] == "Resources"
        canceled = air("cancel", run_id)
        assert canceled.returncode == 0, canceled.stderr + canceled.stdout
        wait_for(lambda: RunStore().get_run(run_id).status.value == "CANCELED", 120, "CANCELED")
        job = str(state["job_id"])
        wait_for(lambda: hpc.tool("squeue", "-h", "-t", "all", "-j", job, "-o", "%T").stdout.strip() in ("", "CANCELLED"), 30,
                 "its job canceled")
    finally:
        hpc.tool("scancel", blocker)
    no_leftover(hpc)


def test_cancel_while_running_leaves_nothing_on_any_node(hpc: SlurmCluster, tmp_path: Path) -> None:
    run_id = submit(workload(tmp_path, 'echo "node $NODE_RANK up"\nsleep 600'))

    def both_up() -> bool:
        logs = RunPaths(run_id).node_logs(0)
        return len(logs) == 2 and all(f"node {n} up" in logs[n].read_text() for n in (0, 1))

    wait_for(lambda: RunStore().get_run(run_id).status.value == "RUNNING", 120, "RUNNING")
    wait_for(both_up, 300, "both nodes' logs followed live")
    canceled = air("cancel", run_id)
    assert canceled.returncode == 0, canceled.stderr + canceled.stdout
    wait_for(lambda: RunStore().get_run(run_id).status.value == "CANCELED", 120, "CANCELED")
    no_leftover(hpc)


def test_a_killed_supervisors_job_is_ended_with_the_run(hpc: SlurmCluster, tmp_path: Path) -> None:
    """The supervisor is gone (SIGKILL: no chance to scancel): the next air command that reconciles ends the
    run INTERNAL_ERROR and its Slurm job with it, on every node (before, the job ran on to its time limit)."""
    import os
    import signal

    run_id = submit(workload(tmp_path, 'echo "node $NODE_RANK up"\nsleep 600'))

    def both_up() -> bool:
        logs = RunPaths(run_id).node_logs(0)
        return len(logs) == 2 and all(f"node {n} up" in logs[n].read_text() for n in (0, 1))

    wait_for(both_up, 300, "both nodes up")
    pid = RunStore().get_run(run_id).supervisor_pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not _alive(pid), 60, "the supervisor to be gone")
    listed = air("list", "runs", "--all-status")  # any command reconciles
    assert listed.returncode == 0, listed.stderr
    run = RunStore().get_run(run_id)
    assert run.status.value == "INTERNAL_ERROR", (run.status, run.termination_reason)
    assert "leftover" in (run.termination_reason or ""), run.termination_reason
    no_leftover(hpc, timeout=60)


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_node_past_the_jobs_memory_is_reported_as_out_of_memory(hpc: SlurmCluster, tmp_path: Path) -> None:
    """The test cluster accounts memory as sites without cgroups do (JobAcctGatherParams=OverMemoryKill):
    node 1 takes 600 MB past the job's --mem 200M, Slurm kills its step, and the run says out of memory."""
    command = ('if [ "$NODE_RANK" = 1 ]; then python3 -c "import time; x = bytearray(600 << 20); time.sleep(60)"; '
               'else sleep 60; fi')
    run_id = submit(workload(tmp_path, command, extra="slurm: {mem: 200M}\n"))
    wait_for(lambda: RunStore().get_run(run_id).status.is_terminal(), 300, "the run to end")
    run = RunStore().get_run(run_id)
    assert run.status.value == "FAILED", (run.status, run.termination_reason)
    assert "memory" in (run.termination_reason or "").lower(), run.termination_reason
    assert "node 1" in (run.termination_reason or ""), run.termination_reason
    logs = RunPaths(run_id).node_logs(0)
    assert "went past the job's memory limit" in logs[0].read_text()
    no_leftover(hpc)


@pytest.mark.timeout(900)  # minutes on 2 busy cores (torch's import, Slurm's time limit)
def test_past_slurms_time_limit_is_timedout(hpc: SlurmCluster, tmp_path: Path) -> None:
    run_id = submit(workload(tmp_path, "sleep 600", extra="slurm: {time: 1}\n"))
    wait_for(lambda: RunStore().get_run(run_id).is_terminal, 400, "the run ended")
    run = RunStore().get_run(run_id)
    assert run.status.value == "TIMEDOUT", (run.status, run.termination_reason)
    assert "TIMEOUT" in RunPaths(run_id).node_logs(0)[0].read_text()
    no_leftover(hpc)


def test_unknown_slurm_key_is_exit_2_with_the_valid_keys(hpc: SlurmCluster, tmp_path: Path) -> None:
    result = air("run", "-f", str(workload(tmp_path, "true", extra="slurm: {cpus-per-task: 2}\n")), "--dry-run")
    assert result.returncode == 2, result.stderr + result.stdout
    text = result.stderr + result.stdout
    assert "did you mean 'cpus_per_task'" in text and "partition, account, qos" in text, text


def test_a_retry_is_a_new_job_resuming_from_the_checkpoint_dir(hpc: SlurmCluster, tmp_path: Path) -> None:
    command = ('if [ "${AIR_RESUMED:-0}" = 1 ]; then echo "resumed at $(cat $AIR_CHECKPOINT_DIR/step)"; exit 0; fi\n'
               'if [ "$NODE_RANK" = 0 ]; then echo 5 > "$AIR_CHECKPOINT_DIR/step"; fi\n'
               "sleep 1\nexit 3")
    run_id = submit(workload(tmp_path, command, retries=1))
    wait_for(lambda: RunStore().get_run(run_id).is_terminal, 400, "the run ended")
    run = RunStore().get_run(run_id)
    assert run.status.value == "SUCCESS", (run.status, run.termination_reason)
    attempts = RunStore().list_attempts(run_id)
    assert [a.status.value for a in attempts][-1] == "SUCCESS" and len(attempts) == 2
    assert "resumed at 5" in RunPaths(run_id).node_logs(1)[0].read_text()
    jobs = {(d / "job_id").read_text() for d in (RunPaths(run_id).folder / "slurm").iterdir()}
    assert len(jobs) == 2  # each attempt its own Slurm job
    no_leftover(hpc)


def test_a_silent_node_is_a_hang_with_stacks(hpc: SlurmCluster, tmp_path: Path) -> None:
    """Progress and stacks come from the nodes through the job folder: a node quiet past the hang timeout
    ends the attempt as HANG, every process's stacks saved."""
    command = 'echo "node $NODE_RANK up"\nif [ "$NODE_RANK" = 1 ]; then sleep 600; fi\nwhile true; do echo tick; sleep 1; done'
    run_id = submit(workload(tmp_path, command, extra="hang_timeout_minutes: 0.15\n"))
    wait_for(lambda: RunStore().get_run(run_id).is_terminal, 400, "the run ended")
    run = RunStore().get_run(run_id)
    assert run.status.value == "FAILED" and "Hang: node 1 made no progress" in (run.termination_reason or ""), \
        run.termination_reason
    stacks = sorted(p.name for p in RunPaths(run_id).stacks(0, "node 1").parent.iterdir())
    assert stacks, "no stacks saved"
    no_leftover(hpc)


@pytest.mark.timeout(900)  # minutes on 2 busy cores (torch's import, Slurm's time limit)
def test_a_node_lost_mid_run_fails_the_attempt_naming_it_and_the_retry_resumes(hpc: SlurmCluster,
                                                                               tmp_path: Path) -> None:
    import json

    import psutil

    command = ('if [ "${AIR_RESUMED:-0}" = 1 ]; then echo "resumed at $(cat $AIR_CHECKPOINT_DIR/step)"; exit 0; fi\n'
               'if [ "$NODE_RANK" = 0 ]; then echo 7 > "$AIR_CHECKPOINT_DIR/step"; fi\n'
               'echo "node $NODE_RANK up"\nsleep 600')
    run_id = submit(workload(tmp_path, command, retries=1))

    def both_up() -> bool:
        logs = RunPaths(run_id).node_logs(0)
        return len(logs) == 2 and all(f"node {n} up" in logs[n].read_text() for n in (0, 1))

    wait_for(both_up, 300, "both nodes up")
    job_dir = next((RunPaths(run_id).folder / "slurm").iterdir())
    launcher = psutil.Process(json.loads((job_dir / "node_1" / "host.json").read_text())["pid"])
    doomed = [launcher.ppid(), launcher.pid, *(p.pid for p in launcher.children(recursive=True))]
    hpc.kill_node("n2", doomed)  # the machine of node 1 goes away, all it ran with it
    try:
        wait_for(lambda: RunStore().list_attempts(run_id)[0].status.value != "RUNNING", 180, "attempt 0 ended")
    finally:
        hpc.revive_node("n2")
    first = RunStore().list_attempts(run_id)[0]
    assert "node 1 (n2" in (first.termination_reason or "") and "NODE_FAIL" in (first.termination_reason or ""), \
        first.termination_reason
    wait_for(lambda: RunStore().get_run(run_id).is_terminal, 300, "the run ended")
    run = RunStore().get_run(run_id)
    assert run.status.value == "SUCCESS", (run.status, run.termination_reason)
    assert "resumed at 7" in RunPaths(run_id).node_logs(1)[0].read_text()
    no_leftover(hpc)


def test_a_slurmctld_restart_mid_run_is_waited_out(hpc: SlurmCluster, tmp_path: Path) -> None:
    """slurmctld stops while a run's job runs (an upgrade, a fail-over) and starts again on its saved state 15 s
    later (squeue fails or hangs meanwhile, past air's 10 s look): the nodes go on, the run waits for the
    controller instead of calling the job lost or its supervisor failing, and it ends SUCCESS with both
    nodes' lines; nothing is left."""
    run_id = submit(workload(tmp_path, 'echo "started $NODE_RANK"\nsleep 5\necho "done $NODE_RANK"'))
    logs = RunPaths(run_id).folder / "attempt_0"
    wait_for(lambda: all((logs / f"node_{n}.log").exists() and f"started {n}" in (logs / f"node_{n}.log").read_text()
                         for n in (0, 1)), 240, "both nodes to start")
    hpc.restart_controller(down_s=15)
    wait_for(lambda: RunStore().get_run(run_id).status.is_terminal(), 240, "the run to end")
    run = RunStore().get_run(run_id)
    supervisor = (RunPaths(run_id).folder / "supervisor.log").read_text()
    assert run.status.value == "SUCCESS", f"{run.status.value}: {run.reason}\n{supervisor}"
    assert "controller does not answer" in supervisor, supervisor
    for node in (0, 1):
        assert f"done {node}" in (logs / f"node_{node}.log").read_text()
    no_leftover(hpc)
