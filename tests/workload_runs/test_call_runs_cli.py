"""What the CLI shows of runs: local `@distributed` calls as runs (kind `call`) with per-rank logs, every
node's lines under `--watch`, and `air logs` following an active run. Real callers, real CLI processes.

(Named *_cli so it does not share a module name with tests/tracking/test_call_runs.py: pytest imports
test files without packages by their base name.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from runs_helpers import air, submit, wait_status, wait_terminal, write_workload

from air.store.paths import RunPaths
from air.store.run_store import Run, RunStore
from proc_helpers import alive, read_pids, wait_for

#: The caller's ranks write their pid here; `sleep` makes them wait to be ended.
CALLER = """
import os, sys, time
from pathlib import Path
from air import distributed

@distributed(num_accelerators=2, accelerator_type="CPU")
def work(mode: str, pid_dir: str) -> int:
    rank = int(os.environ["RANK"])
    print(f"line of rank {rank}", flush=True)
    if mode == "fail" and rank == 1:
        raise ValueError("rank one is unhappy")
    if mode == "sleep":
        Path(pid_dir, f"rank{rank}.pid").write_text(str(os.getpid()))
        time.sleep(1000)
    return rank

try:
    print("RESULT", work.distributed(sys.argv[1], sys.argv[2]), flush=True)
except Exception as exc:
    print("RAISED", type(exc).__name__, str(exc).splitlines()[0], flush=True)
    sys.exit(1)
"""


def run_caller(tmp_path: Path, mode: str, pid_dir: Path | None = None, **popen: Any) -> subprocess.Popen[str]:
    script = tmp_path / "caller.py"
    script.write_text(CALLER)
    return subprocess.Popen(
        [sys.executable, str(script), mode, str(pid_dir or tmp_path)],
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **popen,
        env={**os.environ, "AIR_TRACKING": "off"},
    )


def only_call() -> Run:
    runs = [r for r in RunStore().list_runs(statuses="all") if r.kind == "call"]
    assert len(runs) == 1, runs
    return runs[0]


def running_call_id() -> str | None:
    """The call's run id once it is recorded RUNNING (the recorder writes it while the ranks start)."""
    runs = [r for r in RunStore().list_runs(statuses="all") if r.kind == "call"]
    return runs[0].id if runs and runs[0].status.value == "RUNNING" else None


def test_local_call_is_a_run_with_rank_logs(tmp_path: Path) -> None:
    caller = run_caller(tmp_path, "ok")
    out, err = caller.communicate(timeout=120)
    assert caller.returncode == 0 and "RESULT [0, 1]" in out, err
    listed = air("list", "runs", "--all-status")
    assert listed.returncode == 0, listed.stderr
    header, row = listed.stdout.splitlines()[:2]
    assert header.split()[:3] == ["RUN", "KIND", "STATUS"]
    run = only_call()
    assert row.split()[:3] == [run.id, "call", "SUCCESS"]
    assert (run.run_name, run.backend, run.num_accelerators, run.num_nodes) == ("work", "local", 2, 1)
    assert run.supervisor_pid == caller.pid  # the caller is the run's supervisor

    rank1 = air("logs", run.id, "--rank", "1")
    assert rank1.returncode == 0, rank1.stderr
    assert rank1.stdout.splitlines() == ["line of rank 1"]
    both = air("logs", run.id)  # ended: prints every rank's lines, prefixed, and exits
    assert both.returncode == 0 and {"[rank 0] line of rank 0", "[rank 1] line of rank 1"} <= set(
        both.stdout.splitlines()
    ), both.stderr

    shown = json.loads(air("get", "run", run.id, "--json").stdout)["data"]
    assert shown["kind"] == "call" and shown["status"] == "SUCCESS"
    assert [(r["rank"], Path(r["path"]).name, r["exists"]) for r in shown["rank_logs"]] == [
        (0, "rank_0.log", True),
        (1, "rank_1.log", True),
    ]
    text = air("get", "run", run.id).stdout
    assert shown["rank_logs"][1]["path"] in text and f"air logs {run.id} [--rank N]" in text

    copied = air("logs", run.id, "--download-to", str(tmp_path / "copy"))
    assert copied.returncode == 0 and "Copied 2 log(s) of attempt 0" in copied.stderr, copied.stderr
    assert {p.name: p.read_text().splitlines() for p in (tmp_path / "copy" / "logs").iterdir()} == {
        "rank_0.log": ["line of rank 0"], "rank_1.log": ["line of rank 1"]}

    wrong = air("logs", run.id, "--rank", "2")
    assert wrong.returncode == 2 and "there is no rank 2" in wrong.stderr
    by_node = air("logs", run.id, "--node", "0")
    assert by_node.returncode == 2 and "--rank N" in by_node.stderr


def test_failing_call_is_failed_with_the_ranks_error(tmp_path: Path) -> None:
    caller = run_caller(tmp_path, "fail")
    out, err = caller.communicate(timeout=120)
    assert caller.returncode == 1 and "RAISED ValueError rank one is unhappy" in out, out + err
    run = only_call()
    assert run.status.value == "FAILED"
    assert run.termination_reason == "Rank 1: ValueError: rank one is unhappy"
    assert run.failure_class is not None and run.failure_class.value == "USER_CODE"
    listed = air("list", "runs", "--all-status")
    assert listed.stdout.splitlines()[1].split()[:3] == [run.id, "call", "FAILED"]
    shown = air("get", "run", run.id)
    assert "Rank 1: ValueError: rank one is unhappy" in shown.stdout
    assert "ValueError: rank one is unhappy" in air("logs", run.id, "--rank", "1").stdout


def test_killed_callers_call_is_ended_by_reconcile(tmp_path: Path, pid_dir: Path) -> None:
    caller = run_caller(tmp_path, "sleep", pid_dir)
    wait_for(lambda: len(read_pids(pid_dir)) == 2, "both ranks to start", timeout=60)
    wait_for(running_call_id, "the call to be recorded RUNNING", timeout=30)
    os.kill(caller.pid, signal.SIGKILL)
    caller.communicate(timeout=30)
    listed = air("list", "runs", "--all-status", "--json")  # any air command reconciles
    assert listed.returncode == 0, listed.stderr
    run = only_call()
    assert run.status.value == "INTERNAL_ERROR"
    assert f"The caller of the @distributed call (pid {caller.pid}) died" in (run.termination_reason or "")
    assert json.loads(listed.stdout)["data"]["runs"][0]["status"] == "INTERNAL_ERROR"
    wait_for(lambda: alive(read_pids(pid_dir)) == [], "the ranks to be gone", timeout=30)


def test_air_cancel_ends_a_local_call(tmp_path: Path, pid_dir: Path) -> None:
    caller = run_caller(tmp_path, "sleep", pid_dir)
    wait_for(lambda: len(read_pids(pid_dir)) == 2, "both ranks to start", timeout=60)
    run_id = wait_for(running_call_id, "the call to be recorded RUNNING", timeout=30)
    canceled = air("cancel", str(run_id), "--json")
    assert canceled.returncode == 0, canceled.stderr
    assert json.loads(canceled.stdout)["data"]["runs"] == [{"run_id": run_id, "status": "CANCELED"}]
    out, err = caller.communicate(timeout=60)
    assert caller.returncode == 1 and "RAISED WorkloadFailureException" in out and "canceled" in out, (
        out + err
    )
    assert alive(read_pids(pid_dir)) == []
    assert only_call().status.value == "CANCELED"


def test_watch_streams_every_node_prefixed(tmp_path: Path) -> None:
    path = write_workload(
        tmp_path,
        "two",
        """
        experiment_name: two-nodes
        compute: {num_accelerators: 2, accelerator_type: CPU_1xCPU}
        max_retries: 0
        command: |
          echo "hello from node $NODE_RANK"
    """,
    )
    result = air("run", "-f", str(path), "--watch")
    assert result.returncode == 0, result.stderr + result.stdout
    lines = result.stdout.splitlines()
    assert "[node 1] hello from node 1" in lines and "[node 0] hello from node 0" in lines
    run = RunStore().list_runs(statuses="all")[0]
    assert air("logs", run.id, "--node", "1").stdout.splitlines() == ["hello from node 1"]
    assert set(air("logs", run.id).stdout.splitlines()) == {
        "[node 0] hello from node 0",
        "[node 1] hello from node 1",
    }
    copied = air("logs", run.id, "--download-to", str(tmp_path / "copy"))
    assert copied.returncode == 0 and "Copied 2 log(s) of attempt 0" in copied.stderr, copied.stderr
    assert {p.name: p.read_text().splitlines() for p in (tmp_path / "copy" / "logs").iterdir()} == {
        "node_0.log": ["hello from node 0"], "node_1.log": ["hello from node 1"]}
    no_rank = air("logs", run.id, "--rank", "0")
    assert no_rank.returncode == 2 and "--node N" in no_rank.stderr
    narrowed = air("run", "-f", str(path), "--watch", "--node", "1")
    assert narrowed.returncode == 0, narrowed.stderr
    assert "hello from node 1" in narrowed.stdout.splitlines()
    assert "hello from node 0" not in narrowed.stdout
    for bad in (["--node", "2", "--watch"], ["--node", "1"]):
        refused = air("run", "-f", str(path), *bad)
        assert refused.returncode == 2 and "--node" in refused.stderr, refused.stderr


def test_logs_follow_an_active_run_by_default_and_no_follow_returns(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    path = write_workload(
        tmp_path,
        "gated",
        f"""
        experiment_name: gated
        compute: {{num_accelerators: 2, accelerator_type: CPU_1xCPU}}
        max_retries: 0
        command: |
          echo "started $NODE_RANK"
          while [ ! -e {gate} ]; do sleep 0.1; done
          echo "finished $NODE_RANK"
    """,
    )
    run_id = submit(path)
    wait_status(run_id, "RUNNING")
    wait_for(
        lambda: (
            all("started" in p.read_text() for p in RunPaths(run_id).node_logs(0).values())
            and len(RunPaths(run_id).node_logs(0)) == 2
        ),
        "both nodes to start",
        timeout=60,
    )

    start = time.monotonic()
    printed = air("logs", run_id, "--no-follow", timeout=30)
    assert printed.returncode == 0, printed.stderr
    assert set(printed.stdout.splitlines()) == {"[node 0] started 0", "[node 1] started 1"}
    assert time.monotonic() - start < 30

    follower = subprocess.Popen(
        [sys.executable, "-m", "air.cli.main", "logs", run_id, "--node", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert follower.stdout is not None
    assert follower.stdout.readline().strip() == "started 1"
    time.sleep(1.0)  # it keeps following while the run is active
    assert follower.poll() is None
    gate.touch()
    out, err = follower.communicate(timeout=60)
    assert follower.returncode == 0, err
    assert out.splitlines() == ["finished 1"]
    assert wait_terminal(run_id).status.value == "SUCCESS"
