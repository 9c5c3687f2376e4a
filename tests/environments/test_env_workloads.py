"""`environment.dependencies` in real workload runs: installed, reused, and a failed install ends FAILED."""

from __future__ import annotations

import sys
from pathlib import Path

from env_fixtures import offline_uv_fixture, uv_cache_fixture, wheelhouse_fixture  # noqa: F401

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workload_runs"))
from runs_helpers import air, submit, wait_terminal, write_workload

from air.store.paths import RunPaths
from air.store.run_store import RunStore


def test_workload_imports_its_dependency_and_the_second_run_reuses_it(tmp_path: Path, wheelhouse: Path,
                                                                      air_home: Path) -> None:
    path = write_workload(tmp_path, "deps", f"""
        experiment_name: deps
        compute: {{num_accelerators: 1, accelerator_type: CPU_1xCPU}}
        max_retries: 0
        environment:
          dependencies:
            - --no-index
            - --find-links {wheelhouse}
            - airtest-hello==1.0
        command: |
          python -c "import airtest_hello, yaml; print('imported', airtest_hello.VALUE, 'base yaml', yaml.__version__)"
    """)
    dry = air("run", "-f", str(path), "--dry-run")
    assert dry.returncode == 0 and "state: will build" in dry.stdout
    first = wait_terminal(submit(path), timeout=180)
    assert first.status.value == "SUCCESS", first.termination_reason
    log = RunPaths(first.id).node_log(0, 0).read_text()
    assert "imported hello 1.0 base yaml" in log and "environment built" in log
    assert "state: cached" in air("run", "-f", str(path), "--dry-run").stdout
    second = wait_terminal(submit(path), timeout=180)
    assert second.status.value == "SUCCESS"
    assert "environment reused" in RunPaths(second.id).node_log(0, 0).read_text()
    assert len(list((air_home / "envs").iterdir())) >= 1


def test_dependency_that_cannot_be_installed_fails_the_run_with_its_name(tmp_path: Path, wheelhouse: Path,
                                                                         air_home: Path) -> None:
    path = write_workload(tmp_path, "broken", f"""
        experiment_name: broken
        compute: {{num_accelerators: 1, accelerator_type: CPU_1xCPU}}
        max_retries: 0
        environment:
          dependencies: ["--no-index", "--find-links {wheelhouse}", "airtest-broken==1.0"]
        command: echo never
    """)
    run = wait_terminal(submit(path), timeout=180)
    assert run.status.value == "FAILED"
    assert "airtest-broken" in run.termination_reason and run.failure_class.value == "SETUP"
    attempt = RunStore().list_attempts(run.id)[0]
    assert "airtest-broken" in attempt.termination_reason
    envs = air_home / "envs"
    assert not envs.exists() or not [p for p in envs.iterdir() if (p / ".air-complete").exists()]
    assert "never" not in RunPaths(run.id).node_log(0, 0).read_text().replace("echo never", "")
