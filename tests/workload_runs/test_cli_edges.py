"""CLI edges a new user meets: a dry run that leaves no trace, a failed command's own words as its reason,
hosted-compatible `--json` fields, shell completion of run ids."""

from __future__ import annotations

import json
import shutil
from datetime import datetime, timedelta
from pathlib import Path

from runs_helpers import air, submit, wait_terminal, write_workload

from air.store.run_store import RunStore
from air.store.states import RunStatus
from proc_helpers import tracking_done


def test_dry_run_writes_nothing_under_air_home(tmp_path: Path, air_home: Path) -> None:
    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text("print('hi')\n")
    wheel_dir = tmp_path / "wheels"
    wheel_dir.mkdir()
    path = write_workload(
        tmp_path,
        "dry",
        f"""
        experiment_name: dry
        compute: {{num_accelerators: 1, accelerator_type: CPU_1xCPU}}
        code_source:
          snapshot: {{root_path: {code}}}
        environment:
          dependencies: [--no-index, --find-links {wheel_dir}, airtest-hello==1.0]
        parameters: {{lr: 0.1}}
        command: python train.py
    """,
    )
    shutil.rmtree(air_home, ignore_errors=True)
    for args in (("--dry-run",), ("--dry-run", "--json")):
        result = air("run", "-f", str(path), *args)
        assert result.returncode == 0, result.stderr
        assert "will build" in result.stdout and "train.py" in result.stdout
        assert not air_home.exists(), sorted(str(p) for p in air_home.rglob("*"))


def test_a_command_that_cannot_open_its_script_says_so_as_its_reason(tmp_path: Path) -> None:
    missing = tmp_path / "missing.py"
    path = write_workload(
        tmp_path,
        "missing",
        f"""
        experiment_name: missing
        compute: {{num_accelerators: 1, accelerator_type: CPU_1xCPU}}
        max_retries: 0
        command: |
          echo starting
          python {missing}
    """,
    )
    run_id = submit(path)
    run = wait_terminal(run_id)
    expected = f"python: can't open file '{missing}': [Errno 2] No such file or directory (exit code 2)"
    assert (run.status.value, run.termination_reason) == ("FAILED", expected)
    shown = json.loads(air("get", "run", run_id, "--json").stdout)["data"]
    assert shown["termination_reason"] == expected
    assert expected in air("get", "run", run_id).stdout


def test_json_carries_the_hosted_cli_field_names(tmp_path: Path) -> None:
    path = write_workload(
        tmp_path,
        "hosted",
        """
        experiment_name: hosted
        compute: {num_accelerators: 1, accelerator_type: CPU_1xCPU}
        command: echo hi
    """,
    )
    run_id = submit(path)
    run = wait_terminal(run_id)
    assert run.status.value == "SUCCESS" and run.started_at is not None

    [item] = json.loads(air("list", "runs", "--all-status", "--json").stdout)["data"]["runs"]
    assert {k: item[k] for k in ("run_id", "run_name", "user", "status")} == {
        "run_id": run_id,
        "run_name": "hosted",
        "user": run.user,
        "status": "SUCCESS",
    }
    assert item["user"] and item["id"] == run_id and item["experiment"] == "hosted"  # air's own names stay
    started = item["started_at"]
    assert isinstance(started, str) and started.endswith("Z") and "T" in started
    parsed = datetime.fromisoformat(started.replace("Z", "+00:00"))
    assert parsed.utcoffset() == timedelta(0)
    assert abs(parsed.timestamp() - run.started_at) < 0.001 and item["started_at_epoch"] == run.started_at

    tracking_done(run_id)  # (an ended run's MLflow id is recorded just after its end)
    run = RunStore().get_run(run_id)
    got = json.loads(air("get", "run", run_id, "--json").stdout)["data"]
    assert (got["run_id"], got["status"], got["started_at"], got["experiment_name"]) == (
        run_id,
        "SUCCESS",
        started,
        "hosted",
    )
    assert got["attempt_number"] == 0 and got["termination_reason"] == run.termination_reason
    assert got["duration_seconds"] == run.duration_seconds() and got["duration_seconds"] > 0
    assert got["mlflow_url"] and run.mlflow_run_id and run.mlflow_run_id in got["mlflow_url"]


def _complete(shell: str, words: str, cword: int) -> list[str]:
    """What the shell's completion script gets back from `air` (click's `_AIR_COMPLETE` protocol)."""
    done = air(env={"_AIR_COMPLETE": f"{shell}_complete", "COMP_WORDS": words, "COMP_CWORD": str(cword)})
    assert done.returncode == 0 and not done.stderr, done.stderr
    return [line for line in done.stdout.splitlines() if line]


def test_shell_completion_offers_run_ids_from_the_store(air_home: Path) -> None:
    assert _complete("bash", "air get run ", 3) == [] and not air_home.exists()  # no store: nothing, no trace
    store = RunStore()
    ended = store.create_run(
        experiment="old", accelerator_type="CPU_1xCPU", num_accelerators=1, num_nodes=1
    ).run
    store.transition(ended.id, RunStatus.CANCELED, reason="test")
    active = store.create_run(
        experiment="live", accelerator_type="CPU_1xCPU", num_accelerators=1, num_nodes=1
    ).run

    assert _complete("bash", "air get run ", 3) == [f"plain,{active.id}", f"plain,{ended.id}"]  # newest first
    assert _complete("bash", f"air logs {ended.id[:-2]}", 2) == [f"plain,{ended.id}"]
    assert _complete("bash", "air get run nope", 3) == []
    assert _complete("bash", "air cancel ", 2) == [f"plain,{active.id}"]  # only what can still be canceled
    assert _complete("zsh", "air logs ", 2)[:3] == ["plain", active.id, "PENDING  live"]
    assert _complete("bash", "air pr", 1) == ["plain,prune"]
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    for shell in ("bash", "zsh", "fish"):
        assert f"_AIR_COMPLETE={shell}_source air" in readme


def test_logs_tail_0_prints_nothing_like_tail_n_0(tmp_path: Path) -> None:
    """`air logs ID --tail 0` asks for no lines: it prints none and exits 0, with no word that the log is
    empty (it is not); --tail 1 still shows the last line."""
    path = write_workload(tmp_path, "tail0", """
        experiment_name: tail0
        compute: {num_accelerators: 1, accelerator_type: CPU_1xCPU}
        command: echo first; echo last
    """)
    run_id = submit(path)
    assert wait_terminal(run_id).status == RunStatus.SUCCESS
    none = air("logs", run_id, "--tail", "0")
    assert (none.returncode, none.stdout, none.stderr) == (0, "", "")
    assert air("logs", run_id, "--tail", "1").stdout.splitlines() == ["last"]


def test_profile_help_names_the_configured_default_profile(tmp_path: Path, air_home: Path) -> None:
    """After `air login --default` (config.yaml's default_profile: remote) every `-p` help says the
    default is 'remote', not a fixed 'local'; AIR_PROFILE, when set, is the default it names."""
    air_home.mkdir(parents=True, exist_ok=True)
    token = tmp_path / "token"
    token.write_text("t0k\n")
    (air_home / "config.yaml").write_text(
        "default_profile: remote\n"
        f"profiles:\n  remote: {{backend: server, url: 'http://127.0.0.1:9', token_path: {token}}}\n")
    for args in (("-h",), ("run", "-h"), ("logs", "-h"), ("list", "runs", "-h"), ("server", "token", "list", "-h")):
        shown = air(*args)
        assert shown.returncode == 0, shown.stderr
        text = " ".join(shown.stdout.split())
        assert "(default: 'remote': AIR_PROFILE, else config.yaml's default_profile)" in text, (args, text)
        assert "'local'" not in text, args
    chosen = air("run", "-h", env={"AIR_PROFILE": "other"})
    assert "(default: 'other', from AIR_PROFILE)" in " ".join(chosen.stdout.split())
