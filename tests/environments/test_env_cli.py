"""`air env list` through the real CLI, with a real cached environment (built offline with uv)."""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import datetime
from pathlib import Path

from env_fixtures import offline_uv_fixture, uv_cache_fixture, wheelhouse_fixture  # noqa: F401

from air.environments import ensure_environment, parse_dependencies

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workload_runs"))
from runs_helpers import air, submit, wait_status, wait_terminal, write_workload

from air.store.paths import RunPaths


def test_env_list_prints_a_table_of_cached_environments(tmp_path: Path, wheelhouse: Path) -> None:
    assert air("env", "list").stdout.strip() == "No cached environments."
    deps = parse_dependencies(["--no-index", f"--find-links {wheelhouse}", "airtest-hello"], tmp_path)
    env = ensure_environment(deps, Path(sys.executable), log=lambda line: None)

    table = air("env", "list")
    assert table.returncode == 0, table.stderr
    header, *rows = [line for line in table.stdout.splitlines() if line.strip()]
    assert header.split()[:2] == ["KEY", "SIZE"] and "LAST USED" in header and "DEPENDENCIES" in header
    [row] = rows
    assert row.startswith(env.key[:12]) and " MB " in row and "airtest-hello" in row
    listed = json.loads(air("env", "list", "--json").stdout)["data"]["environments"]
    [entry] = listed
    created = datetime.fromisoformat(entry["created"]).astimezone().strftime("%Y-%m-%d %H:%M:%S")
    last_used = datetime.fromisoformat(entry["last_used"]).astimezone().strftime("%Y-%m-%d %H:%M:%S")
    assert created in row and last_used in row


def test_prune_removes_an_unused_environment_but_not_one_a_waiting_run_will_use(
    tmp_path: Path, wheelhouse: Path, air_home: Path
) -> None:
    def workload(name: str, command: str, slots: int = 1, deps: str = "airtest-hello") -> Path:
        env = (
            f"environment: {{dependencies: [--no-index, --find-links {wheelhouse}, {deps}]}}" if deps else ""
        )
        return write_workload(
            tmp_path,
            name,
            f"""
            experiment_name: {name}
            compute: {{num_accelerators: {slots}, accelerator_type: CPU_{slots}xCPU}}
            max_retries: 0
            {env}
            command: {command}
        """,
        )

    # Submitted together (each builds its own environment), then waited for.
    first_id = submit(workload("first", "python -c 'import airtest_hello'"))
    other_id = submit(workload("other", "echo other", deps="airtest-other"))
    first, other = wait_terminal(first_id, timeout=180), wait_terminal(other_id, timeout=180)
    assert first.status.value == other.status.value == "SUCCESS", (
        first.termination_reason,
        other.termination_reason,
    )
    envs = {
        e["dependencies"][-1]: e["key"]
        for e in json.loads(air("env", "list", "--json").stdout)["data"]["environments"]
    }
    for key in envs.values():
        marker = air_home / "envs" / key / ".air-last-used"
        os.utime(marker, (time.time() - 10 * 86400,) * 2)

    holder = submit(workload("holder", "sleep 1000", slots=8, deps=""))  # takes every CPU slot
    wait_status(holder, "RUNNING")
    waiting = submit(workload("waiting", "python -c 'import airtest_hello'"))  # queued behind it
    wait_status(waiting, "QUEUED")

    dry = json.loads(air("prune", "--older-than-days", "7", "--dry-run", "--json").stdout)["data"]
    assert (
        dry["environments"] == [envs["airtest-other"]]
        and envs["airtest-hello"] in dry["kept_for_active_runs"]
    )
    assert (air_home / "envs" / envs["airtest-other"]).is_dir()
    done = json.loads(air("prune", "--older-than-days", "7", "--json").stdout)["data"]
    assert done["environments"] == [envs["airtest-other"]]
    assert not (air_home / "envs" / envs["airtest-other"]).exists()
    assert (air_home / "envs" / envs["airtest-hello"] / ".air-complete").is_file()

    assert air("cancel", holder).returncode == 0
    ran = wait_terminal(waiting, timeout=180)
    assert (
        ran.status.value == "SUCCESS" and "environment reused" in RunPaths(waiting).node_log(0, 0).read_text()
    )
