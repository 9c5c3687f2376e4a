"""`air prune` / `air gc` through the real CLI: old ended runs, calls and snapshots go; an active run and
the snapshot it uses stay; a dry run deletes nothing."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from runs_helpers import air, submit, wait_status, wait_terminal, write_workload

from air.runs.prune import prune
from air.store.liveness import process_create_time
from air.store.paths import RunPaths
from air.store.run_store import RunStore
from air.store.states import RunStatus
from proc_helpers import tracking_done, wait_for

TEN_DAYS_AGO = time.time() - 10 * 86400


def _age(path: Path) -> None:
    """Make a folder and everything in it look untouched for ten days."""
    for item in [path, *path.rglob("*")]:
        os.utime(item, (TEN_DAYS_AGO, TEN_DAYS_AGO), follow_symlinks=False)


def _listing(air_home: Path) -> list[str]:
    """Every path under AIR_HOME but MLflow's store and the progress notes an active run's controller
    rewrites every second (`attempt_<a>/progress.json` and its atomic-write temp file)."""
    return sorted(
        str(p) for p in air_home.rglob("*")
        if "mlflow" not in p.name and "mlartifacts" not in str(p)
        and p.name != "progress.json" and not p.name.startswith(".progress.json.")
    )


def _snapshot_workload(tmp_path: Path, name: str, command: str) -> Path:
    code = tmp_path / f"code-{name}"
    code.mkdir()
    (code / "train.py").write_text(f"print({name!r})\n")
    return write_workload(
        tmp_path,
        name,
        f"""
        experiment_name: {name}
        compute: {{num_accelerators: 1, accelerator_type: CPU_1xCPU}}
        max_retries: 0
        code_source:
          snapshot: {{root_path: {code}}}
        command: {command}
    """,
    )


def _prune(*args: str) -> dict:
    result = air("prune", "--older-than-days", "7", "--json", *args)
    assert result.returncode == 0, result.stderr + result.stdout
    return json.loads(result.stdout)["data"]


def test_prune_removes_old_ended_things_and_keeps_what_is_active(tmp_path: Path, air_home: Path) -> None:
    # Submitted together (they run side by side on their own slots), then waited for.
    old_id, recent_id, active_id = (submit(_snapshot_workload(tmp_path, name, command)) for name, command in (
        ("old", "python train.py"), ("recent", "python train.py"), ("active", "echo started && sleep 1000")))
    old, recent = wait_terminal(old_id), wait_terminal(recent_id)
    wait_status(active_id, "RUNNING")
    # Its command runs: every file of its attempt is written (but the progress notes, see _listing).
    wait_for(lambda: "started" in RunPaths(active_id).node_log(0, 0).read_text(), "the active run's command", 60)
    # Its MLflow run is made beside the command (on a busy machine, after it started): its record too.
    wait_for(lambda: RunPaths(active_id).tracking(0).exists(), "the active run's MLflow record", 120)
    assert old.status.value == recent.status.value == "SUCCESS"
    # A supervisor still writes its run's last lines after the state says SUCCESS; prune keeps such a
    # run (test_a_run_whose_supervisor_is_still_finishing_is_kept), so wait until it has exited.
    tracking_done(old.id)

    call = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent("""
        from air import distributed
        print(distributed(num_accelerators=1, accelerator_type="CPU")(lambda: 7).distributed())
    """),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "AIR_TRACKING": "off"},
    )
    assert call.returncode == 0 and "[7]" in call.stdout, call.stderr
    # A call is a run (kind `call`) with its own run folder: pruned by the same rule as the workloads.
    [call_id] = [r.id for r in RunStore().list_runs(statuses="all", limit=None) if r.kind == "call"]
    call_dir = RunPaths(call_id).folder

    def key_of(run_id: str) -> str:
        return json.loads(RunPaths(run_id).submission.read_text())["code_key"]

    snapshots = air_home / "snapshots"
    old_key, recent_key, active_key = key_of(old.id), key_of(recent.id), key_of(active_id)
    assert {old_key, recent_key, active_key} <= {p.name for p in snapshots.iterdir()}
    with sqlite3.connect(air_home / "runs.db") as db:  # the old run ended ten days ago
        db.execute("UPDATE runs SET ended_at = ? WHERE id IN (?, ?)", (TEN_DAYS_AGO, old.id, call_id))
    for path in (snapshots / old_key, snapshots / active_key, RunPaths(old.id).folder, call_dir):
        _age(path)
    before = _listing(air_home)

    dry = _prune("--dry-run")
    assert dry["dry_run"] is True
    assert (sorted(dry["runs"]), dry["calls"], dry["snapshots"]) == (sorted([old.id, call_id]), [], [old_key])
    assert active_key in dry["kept_for_active_runs"] and dry["bytes"] > 0
    after = _listing(air_home)
    assert after == before  # a dry run deletes nothing
    text = air("gc", "--older-than-days", "7", "--dry-run")
    assert (
        text.returncode == 0
        and old.id in text.stdout
        and "Would remove 2 run(s), 0 call(s), 1 snapshot(s)" in text.stderr
    )

    done = _prune()
    assert (sorted(done["runs"]), done["calls"], done["snapshots"]) == (sorted([old.id, call_id]), [], [old_key])
    assert (
        not RunPaths(old.id).folder.exists() and not call_dir.exists() and not (snapshots / old_key).exists()
    )
    gone = air("get", "run", old.id)
    assert gone.returncode == 2 and "not found" in gone.stderr.lower()
    store = RunStore()
    assert store.get_run(active_id).status.value == "RUNNING" and RunPaths(active_id).folder.is_dir()
    assert (snapshots / active_key).is_dir() and (snapshots / recent_key).is_dir()
    assert store.get_run(recent.id).status.value == "SUCCESS" and RunPaths(recent.id).node_log(0, 0).exists()
    assert _prune()["runs"] == []  # nothing more to do

    assert air("cancel", active_id).returncode == 0
    wait_terminal(active_id)


def test_a_run_whose_supervisor_is_still_finishing_is_kept(air_home: Path) -> None:
    # An ended run whose recorded supervisor (this very process) is alive: it may still write the run's
    # last lines, so prune keeps its row and folder and says why; once that process is gone it goes.
    store = RunStore()
    run = store.create_run(experiment="e", accelerator_type="CPU_1xCPU", num_accelerators=1, num_nodes=1).run
    store.set_supervisor(run.id, os.getpid(), process_create_time(os.getpid()))
    store.transition(run.id, RunStatus.RUNNING)
    store.transition(run.id, RunStatus.SUCCESS)
    RunPaths(run.id).folder.mkdir(parents=True)
    with sqlite3.connect(air_home / "runs.db") as db:
        db.execute("UPDATE runs SET ended_at = ? WHERE id = ?", (TEN_DAYS_AGO, run.id))

    kept = prune(7)
    assert kept.runs == [] and any(run.id in note and "still finishing" in note for note in kept.notes)
    assert RunPaths(run.id).folder.is_dir() and store.get_run(run.id).status == RunStatus.SUCCESS

    gone_pid = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True)
    store.set_supervisor(run.id, int(gone_pid.stdout), time.time() - 5)
    assert prune(7).runs == [run.id] and not RunPaths(run.id).folder.exists()


def test_prune_refuses_a_negative_age_and_creates_nothing(air_home: Path) -> None:
    bad = air("prune", "--older-than-days", "-1")
    assert bad.returncode == 2 and "--older-than-days" in bad.stderr
    empty = air("prune", "--json")
    assert empty.returncode == 0 and json.loads(empty.stdout)["data"]["count"] == 0
    assert not air_home.exists()
