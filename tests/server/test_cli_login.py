"""`air login URL` (issue 27): a server profile whose token sits in an owner-only file, read from stdin
(never an argument); afterwards plain `air list runs` goes to that server."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

from server_helpers import AIR, AirServer


def _client_env(home: Path) -> dict[str, str]:
    """A laptop's environment: its own AIR_HOME, no AIR_SERVER_URL/AIR_TOKEN."""
    env = {k: v for k, v in os.environ.items() if k not in ("AIR_SERVER_URL", "AIR_TOKEN", "AIR_PROFILE")}
    return {**env, "AIR_HOME": str(home)}


def _air(home: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*AIR, *args], env=_client_env(home), capture_output=True, text=True, timeout=120,
                          input=stdin if stdin is not None else "")


def test_login_saves_a_private_token_and_list_runs_goes_to_the_server(shared_server: AirServer, tmp_path: Path) -> None:
    server = shared_server
    spec = tmp_path / "hello.yaml"
    spec.write_text("experiment_name: hello\ncompute: {accelerator_type: CPU_1xCPU, num_accelerators: 1}\n"
                    "command: echo hi\n")
    run_id = server.air_json("alice", "run", "-f", str(spec))["run_id"]
    server.wait_status(run_id, "SUCCESS")
    home, token = tmp_path / "laptop", server.tokens["alice"]

    done = _air(home, "login", server.url, stdin=token + "\n")
    assert done.returncode == 0, done.stderr
    assert "as alice" in done.stderr and token not in done.stderr + done.stdout
    token_file = home / "tokens" / "remote.token"
    assert token_file.read_text().strip() == token
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(token_file.parent.stat().st_mode) == 0o700
    config = (home / "config.yaml").read_text()
    assert token not in config and "default_profile: remote" in config and server.url in config

    listed = _air(home, "list", "runs", "--all-status", "--json")
    assert listed.returncode == 0, listed.stderr
    assert [r["run_id"] for r in json.loads(listed.stdout)["data"]["runs"]] == [run_id]
    assert run_id in _air(home, "list", "runs").stdout  # nothing active: the recently ended, from the server
    local = _air(home, "-p", "local", "list", "runs", "--all-status", "--json")
    assert local.returncode == 0 and json.loads(local.stdout)["data"]["runs"] == [], local.stderr


def test_a_refused_or_missing_token_saves_nothing(shared_server: AirServer, tmp_path: Path) -> None:
    server = shared_server
    home = tmp_path / "laptop"
    wrong = _air(home, "login", server.url, stdin="not-a-token\n")
    assert wrong.returncode == 2, wrong.stderr
    assert f"The air server at {server.url} refused the token" in wrong.stderr
    empty = _air(home, "login", server.url, stdin="")
    assert empty.returncode == 2 and "No token given" in empty.stderr, empty.stderr
    as_argument = _air(home, "login", server.url, server.tokens["bob"])
    assert as_argument.returncode == 2, as_argument.stderr
    assert not (home / "config.yaml").exists() and not (home / "tokens").exists()
    assert server.tokens["bob"] not in as_argument.stderr  # not echoed back either


def test_login_under_another_profile_name_keeps_the_default(shared_server: AirServer, tmp_path: Path) -> None:
    server = shared_server
    home = tmp_path / "laptop"
    done = _air(home, "login", server.url, "-p", "team", "--no-default", stdin=server.tokens["bob"])
    assert done.returncode == 0, done.stderr
    assert "default_profile" not in (home / "config.yaml").read_text()
    whoami = _air(home, "-p", "team", "list", "runs", "--json")
    assert whoami.returncode == 0 and json.loads(whoami.stdout)["data"]["runs"] == [], whoami.stderr
