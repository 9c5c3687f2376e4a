"""`air env list` through the real CLI, with a real cached environment (built offline with uv)."""

from __future__ import annotations

import json
import sys
from datetime import datetime
from pathlib import Path

from env_fixtures import offline_uv_fixture, uv_cache_fixture, wheelhouse_fixture  # noqa: F401

from air.environments import ensure_environment, parse_dependencies

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workload_runs"))
from runs_helpers import air  # noqa: E402


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
