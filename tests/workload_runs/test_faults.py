"""Long runs survive faults, end to end through the real CLI, supervisor and node processes: a silent
node is ended as hung (stacks saved, nothing left running), a busy one is not, and a retried attempt
resumes from the checkpoint folder its failed attempt left."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from runs_helpers import air, submit, wait_terminal, write_workload

from air.store.paths import RunPaths
from proc_helpers import alive, read_pids


def test_a_silent_node_is_ended_as_hung_with_its_stacks_and_nothing_left(tmp_path: Path, pid_dir: Path) -> None:
    path = write_workload(tmp_path, "hang", f"""
        experiment_name: hang
        compute: {{num_accelerators: 2, accelerator_type: CPU_1xCPU}}
        max_retries: 0
        hang_timeout_minutes: 0.25
        command: |
          echo $$ > {pid_dir}/node$NODE_RANK.pid
          if [ "$NODE_RANK" = 1 ]; then
            echo "node 1 going quiet"
            exec {sys.executable} -c "import os, time; open('{pid_dir}/py1.pid', 'w').write(str(os.getpid())); time.sleep(1000)"
          fi
          while true; do echo tick; sleep 1; done
    """)
    started = time.monotonic()
    run_id = submit(path)
    run = wait_terminal(run_id, timeout=90)
    took = time.monotonic() - started
    reason = run.termination_reason or ""
    assert run.status.value == "FAILED" and reason.startswith("Hang: node 1 made no progress for 1"), reason
    assert took < 60, f"hang noticed only after {took:.0f} s"
    attempt = RunStore_attempt(run_id)
    assert attempt["failure_class"] == "HANG"
    stacks = RunPaths(run_id).stacks(0, "node 1")
    text = stacks.read_text()
    assert "time.sleep" in text or "<module>" in text, text  # py-spy's dump of the sleeping Python
    assert RunPaths(run_id).stacks(0, "node 0").exists()
    pids = read_pids(pid_dir)
    assert len(pids) == 3 and alive(pids) == []
    shown = air("get", "run", run_id, "--json")
    assert shown.returncode == 0, shown.stderr
    progress = json.loads(shown.stdout)["data"]["progress"]
    assert any(p["name"] == "node 1" and p["silent_s"] >= 14 for p in progress), progress


def RunStore_attempt(run_id: str) -> dict[str, object]:  # reads like the store's record
    from air.store.run_store import RunStore

    attempt = RunStore().list_attempts(run_id)[0]
    return {"failure_class": str(attempt.failure_class)}


def test_a_node_that_prints_or_beats_is_never_flagged(tmp_path: Path) -> None:
    script = tmp_path / "beat.py"  # trains without a word: only heartbeats
    script.write_text("import time, air.runtime as r\nend = time.time() + 14\n"
                      "while time.time() < end:\n    r.heartbeat()\n    time.sleep(0.01)\n")
    beat = f"{sys.executable} {script}"
    path = write_workload(tmp_path, "busy", f"""
        experiment_name: busy
        compute: {{num_accelerators: 2, accelerator_type: CPU_1xCPU}}
        max_retries: 0
        hang_timeout_minutes: 0.1
        command: |
          if [ "$NODE_RANK" = 0 ]; then for i in $(seq 14); do echo "step $i"; sleep 1; done; exit 0; fi
          {beat}
    """)
    run = wait_terminal(submit(path), timeout=90)
    assert run.status.value == "SUCCESS", run.termination_reason


def test_a_retried_attempt_resumes_from_the_checkpoint_folder(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        "import os, pathlib, sys\n"
        "from air import runtime\n"
        "ckpt = pathlib.Path(runtime.checkpoint_dir()) / 'step'\n"
        "start = int(ckpt.read_text()) if ckpt.exists() else 0\n"
        "print(f'attempt {os.environ[\"AIR_ATTEMPT\"]} resumed={os.environ[\"AIR_RESUMED\"]} from step {start}')\n"
        "for step in range(start, 6):\n"
        "    ckpt.write_text(str(step + 1))\n"
        "    if step == 2 and os.environ['AIR_ATTEMPT'] == '0':\n"
        "        sys.exit('simulated crash at step 3')\n"
        "print('done at', ckpt.read_text())\n")
    path = write_workload(tmp_path, "resume", f"""
        experiment_name: resume
        compute: {{num_accelerators: 1, accelerator_type: CPU_1xCPU}}
        max_retries: 1
        command: {sys.executable} {script}
    """)
    run_id = submit(path)
    run = wait_terminal(run_id, timeout=90)
    assert run.status.value == "SUCCESS", run.termination_reason
    paths = RunPaths(run_id)
    first = paths.node_log(0, 0).read_text()
    second = paths.node_log(1, 0).read_text()
    assert "attempt 0 resumed=0 from step 0" in first and "simulated crash" in first
    assert "attempt 1 resumed=1 from step 3" in second and "done at 6" in second
    assert (paths.checkpoints() / "step").read_text() == "6"
    shown = json.loads(air("get", "run", run_id, "--json").stdout)["data"]
    assert shown["checkpoint_dir"] == str(paths.checkpoints())
    assert shown["latest_checkpoint"] == str(paths.checkpoints() / "step")
