"""Why a node's ranks failed or hang, as torchrun would say it, end to end through the real CLI, supervisor
and node processes: a `@record`-decorated program's root cause is read from its TORCHELASTIC_ERROR_FILE,
and a one-process node command that waits in the rendezvous for the node-level WORLD_SIZE ranks (as
`accelerate launch --cpu` does) is told so in its hang reason."""

from __future__ import annotations

import sys
from pathlib import Path

from runs_helpers import submit, wait_terminal, write_workload

from proc_helpers import alive, read_pids


def test_a_one_process_node_waiting_for_world_size_ranks_says_so_in_its_hang_reason(
        tmp_path: Path, pid_dir: Path) -> None:
    script = tmp_path / "one_process.py"  # what `accelerate launch --cpu` runs: one process, the node's env
    script.write_text(
        "import os, sys\n"
        f"open({str(pid_dir)!r} + '/py.pid', 'w').write(str(os.getpid()))\n"
        "import torch.distributed as dist\n"
        "os.environ.setdefault('RANK', '0')\n"
        "dist.init_process_group('gloo')\n")
    path = write_workload(tmp_path, "rendezvous", f"""
        experiment_name: rendezvous
        compute: {{num_accelerators: 2, accelerator_type: CPU_2xCPU}}
        max_retries: 0
        hang_timeout_minutes: 0.25
        command: |
          echo $$ > {pid_dir}/node.pid
          {sys.executable} {script}
    """)
    run = wait_terminal(submit(path), timeout=150)
    reason = run.termination_reason or ""
    assert run.status.value == "FAILED" and reason.startswith("Hang: node 0"), reason
    assert "the node runs 1 process but WORLD_SIZE=2: the rendezvous waits for 2 ranks" in reason, reason
    assert "--num_processes" in reason, reason
    pids = read_pids(pid_dir)
    assert len(pids) == 2 and alive(pids) == []


def test_a_record_decorated_program_s_root_cause_is_read_from_its_torchelastic_error_file(tmp_path: Path) -> None:
    """torch's `@record` writes the exception and its traceback to TORCHELASTIC_ERROR_FILE, as torchrun's
    workers (and torchrun itself, for its failed worker) do: the run's reason is that exception and where
    it was raised, even when the program's last words on its output are something else."""
    script = tmp_path / "train.py"
    script.write_text(
        "import os, sys\n"
        "from torch.distributed.elastic.multiprocessing.errors import record\n"
        "print('error file:', os.environ.get('TORCHELASTIC_ERROR_FILE'), flush=True)\n"
        "def check(lr):\n"
        "    raise ValueError(f'bad lr {lr}')\n"
        "@record\n"
        "def main():\n"
        "    check(7)\n"
        "if __name__ == '__main__':\n"
        "    try:\n"
        "        main()\n"
        "    except ValueError:\n"
        "        print('error: shutting the data loaders down', flush=True)\n"
        "        sys.exit(3)\n")
    path = write_workload(tmp_path, "recorded", f"""
        experiment_name: recorded
        compute: {{num_accelerators: 1, accelerator_type: CPU_1xCPU}}
        max_retries: 0
        command: |
          {sys.executable} {script}
    """)
    run = wait_terminal(submit(path), timeout=120)
    reason = run.termination_reason or ""
    assert run.status.value == "FAILED", reason
    assert reason.startswith("ValueError: bad lr 7, raised at train.py:5 in check"), reason
    assert run.failure_class is not None and run.failure_class.value == "USER_CODE"


def test_torchrun_inside_a_node_hands_its_failed_worker_s_root_cause_to_the_run(tmp_path: Path) -> None:
    """torchrun gives each worker its own error file and, failing, copies the first failed worker's root
    cause to its own TORCHELASTIC_ERROR_FILE (the node's): the run says that worker's exception."""
    script = tmp_path / "train.py"
    script.write_text(
        "import os\n"
        "from torch.distributed.elastic.multiprocessing.errors import record\n"
        "@record\n"
        "def main():\n"
        "    if os.environ['RANK'] == '1':\n"
        "        raise RuntimeError('shard 1 is corrupt')\n"
        "if __name__ == '__main__':\n"
        "    main()\n")
    torchrun = Path(sys.executable).with_name("torchrun")
    path = write_workload(tmp_path, "torchrun", f"""
        experiment_name: torchrun
        compute: {{num_accelerators: 2, accelerator_type: CPU_2xCPU}}
        max_retries: 0
        command: |
          {torchrun} --standalone --nproc-per-node=$LOCAL_WORLD_SIZE {script}
    """)
    run = wait_terminal(submit(path), timeout=180)
    reason = run.termination_reason or ""
    assert run.status.value == "FAILED", reason
    assert reason.startswith("RuntimeError: shard 1 is corrupt, raised at train.py:6 in main"), reason
