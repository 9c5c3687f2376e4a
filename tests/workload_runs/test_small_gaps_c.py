"""The hosted product's small gaps (issue 26), through the real CLI on this machine:
`air list runs --filter status=/user=`, `air list pools`, `air logs --minutes N` and the line times it
reads, and the runtime helpers."""

from __future__ import annotations

import getpass
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from runs_helpers import air, submit, wait_terminal, write_workload

from air.launcher.pump import times_path
from air.store.paths import RunPaths
from air.views.logtail import lines_since, offset_since


def workload(folder: Path, name: str, command: str) -> Path:
    return write_workload(folder, name, f"""\
        experiment_name: {name}
        compute: {{num_accelerators: 1, accelerator_type: CPU_1xCPU}}
        max_retries: 0
        command: {json.dumps(command)}
        """)


def listed(*args: str) -> list[dict[str, str]]:
    result = air("list", "runs", "--json", *args)
    assert result.returncode == 0, result.stdout + result.stderr
    return list(json.loads(result.stdout)["data"]["runs"])


def test_filters_by_status_and_user(tmp_path: Path) -> None:
    ok = submit(workload(tmp_path, "gaps-ok", "echo fine"))
    bad = submit(workload(tmp_path, "gaps-bad", "exit 3"))
    assert wait_terminal(ok).status.value == "SUCCESS"
    assert wait_terminal(bad).status.value == "FAILED"

    assert [r["id"] for r in listed("--filter", "status=FAILED")] == [bad]
    assert [r["id"] for r in listed("--filter", "status=success")] == [ok]
    both = {r["id"] for r in listed("--filter", "status=FAILED", "--filter", "status=SUCCESS")}
    assert both == {ok, bad} == {r["id"] for r in listed("--filter", "status=failed,success")}
    # a status filter narrows --all-status; filters combine
    assert [r["id"] for r in listed("--all-status", "--filter", "status=FAILED")] == [bad]
    assert [r["id"] for r in listed("--filter", "status=FAILED", "--filter", "experiment=gaps-ok")] == []

    me = getpass.getuser()
    assert {r["id"] for r in listed("--all-status", "--filter", f"user={me}")} == {ok, bad}
    assert listed("--all-status", "--filter", "user=somebody-else") == []
    text = air("list", "runs", "--all-status", "--filter", f"user={me}")
    assert text.returncode == 0 and "USER" in text.stdout and me in text.stdout


def test_bad_filters_are_exit_2_saying_what_is_valid() -> None:
    unknown = air("list", "runs", "--filter", "colour=red")
    assert unknown.returncode == 2
    assert "Unknown filter key 'colour'; the valid keys are status, user, experiment, accelerator_type, " \
           "num_accelerators." in unknown.stderr
    status = air("list", "runs", "--filter", "status=DONE")
    assert status.returncode == 2 and "Unknown run status 'DONE'" in status.stderr and "SUCCESS" in status.stderr
    twice = air("list", "runs", "--filter", "user=a", "--filter", "user=b")
    assert twice.returncode == 2 and "--filter user= is given twice" in twice.stderr
    shape = air("list", "runs", "--filter", "status")
    assert shape.returncode == 2 and "must look like KEY=VALUE" in shape.stderr


def test_list_pools_is_get_pools() -> None:
    got, listed_ = air("get", "pools", "--json"), air("list", "pools", "--json")
    assert got.returncode == 0 and listed_.returncode == 0, got.stderr + listed_.stderr
    assert json.loads(got.stdout)["data"] == json.loads(listed_.stdout)["data"]
    assert json.loads(listed_.stdout)["data"]["pools"]  # this machine's CPU slots, at least


def test_the_launcher_keeps_line_times_beside_the_log(tmp_path: Path) -> None:
    run_id = submit(workload(tmp_path, "gaps-times", "echo early; sleep 2.5; echo late"))
    assert wait_terminal(run_id).status.value == "SUCCESS"
    log = RunPaths(run_id).node_logs(0)[0]
    marks = [tuple(int(v) for v in line.split()) for line in Path(times_path(log)).read_text().splitlines()]
    assert len(marks) >= 2 and marks[-1][1] - marks[0][1] >= 2  # one mark per second that wrote lines
    data = log.read_bytes()
    assert data[marks[0][0]:].startswith(b"early") and data[marks[-1][0]:].startswith(b"late")
    # the marks answer "since when": everything since the first second, only "late" after it
    assert lines_since(log, marks[0][1], 100) == ["early", "late"]
    assert lines_since(log, marks[-1][1], 100) == ["late"]
    assert lines_since(log, time.time() + 5, 100) == [] and offset_since(log, time.time() + 5) == len(data)


def test_logs_minutes_shows_only_the_last_n_minutes(tmp_path: Path) -> None:
    """A log whose first lines were written 10 minutes ago: the run's real log and marks, with the marks of
    the early lines moved 10 minutes back (what they would be had the command slept 10 minutes)."""
    run_id = submit(workload(tmp_path, "gaps-minutes", "echo early one; echo early two; sleep 2.5; echo late"))
    assert wait_terminal(run_id).status.value == "SUCCESS"
    log = RunPaths(run_id).node_logs(0)[0]
    marks_file = Path(times_path(log))
    marks = [[int(v) for v in line.split()] for line in marks_file.read_text().splitlines()]
    late_at = log.read_bytes().index(b"late")
    aged = [[off, second - 600 if off < late_at else second] for off, second in marks]
    marks_file.write_text("".join(f"{off} {second}\n" for off, second in aged))

    recent = air("logs", run_id, "--minutes", "5")
    assert recent.returncode == 0, recent.stderr
    assert recent.stdout.splitlines() == ["late"]
    everything = air("logs", run_id, "--minutes", "15")
    assert everything.stdout.splitlines() == ["early one", "early two", "late"]
    assert air("logs", run_id).stdout.splitlines() == ["early one", "early two", "late"]

    marks_file.write_text("".join(f"{off} {second - 600}\n" for off, second in marks))  # all 10 minutes old
    none = air("logs", run_id, "--minutes", "2")
    assert none.returncode == 0 and none.stdout == "" and "No log lines in the last 2 minutes" in none.stderr

    both = air("logs", run_id, "--minutes", "2", "--tail", "5")
    assert both.returncode == 2 and "--minutes chooses lines by time" in both.stderr
    zero = air("logs", run_id, "--minutes", "0")
    assert zero.returncode == 2


def test_runtime_helpers_outside_and_inside_a_rank() -> None:
    code = ("import air, serverless_gpu.runtime as r; "
            "print(air.get_replica_rank(), r.get_replica_rank(), air.get_node_ip() == r.get_node_ip())")
    env = {k: v for k, v in os.environ.items() if k != "REPLICA_RANK"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.stdout.split() == ["0", "0", "True"], out.stderr
    out = subprocess.run([sys.executable, "-c", "import air; print(air.get_replica_rank(), air.get_node_ip())"],
                         capture_output=True, text=True, env={**env, "REPLICA_RANK": "3"}, timeout=60)
    replica, ip = out.stdout.split()
    assert replica == "3" and len(ip.split(".")) == 4
