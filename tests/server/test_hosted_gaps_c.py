"""Issue 26, part C through a real `air server`: a workload with `_bases_` (merged by the client before it
submits), `air list runs --filter status=/user=`, and `air logs --minutes N` (the cutoff taken on the
server, whose machine holds the logs and their line times)."""

from __future__ import annotations

import json
from pathlib import Path

from server_helpers import AirServer


def test_bases_filters_and_minutes_through_the_server(server: AirServer, tmp_path: Path) -> None:
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "base.yaml").write_text(
        "compute: {num_accelerators: 1, accelerator_type: CPU_1xCPU}\nmax_retries: 0\n"
        "env_variables: {WHO: base, WHAT: base}\n")
    (tmp_path / "mid.yaml").write_text("_bases_: [shared/base.yaml]\nenv_variables: {WHAT: mid}\n")
    good = tmp_path / "good.yaml"
    good.write_text("_bases_: [mid.yaml]\nexperiment_name: gaps-good\n"
                    'command: echo "early $WHO $WHAT"; sleep 2.5; echo late\n')
    bad = tmp_path / "bad.yaml"
    bad.write_text("_bases_: [mid.yaml]\nexperiment_name: gaps-bad\ncommand: exit 4\n")

    dry = server.air("alice", "run", "-f", str(good), "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    assert json.loads(dry.stdout)["data"]["plan"]["nodes"][0]["env"]["WHAT"] == "mid"
    alice_run = str(server.air_json("alice", "run", "-f", str(good))["run_id"])
    bob_run = str(server.air_json("bob", "run", "-f", str(bad))["run_id"])
    assert server.wait_status(alice_run, "SUCCESS", "FAILED") == "SUCCESS"
    assert server.wait_status(bob_run, "SUCCESS", "FAILED") == "FAILED"

    def ids(user: str, *filters: str) -> list[str]:
        return [r["id"] for r in server.air_json(user, "list", "runs", *filters)["runs"]]

    assert ids("alice", "--filter", "status=FAILED", "--filter", "user=bob") == [bob_run]
    assert ids("alice", "--filter", "status=FAILED") == []  # her own runs by default: none failed
    assert ids("alice", "--all-users", "--filter", "status=failed,success") == [bob_run, alice_run]
    assert ids("bob", "--all-status", "--filter", "user=alice") == [alice_run]
    unknown = server.air("alice", "list", "runs", "--filter", "owner=bob")
    assert unknown.returncode == 2 and "the valid keys are status, user" in unknown.stderr

    # the merged spec was what the server received: bases, their values and none of the `_bases_` key
    logs = server.air("alice", "logs", alice_run, "--minutes", "5")
    assert logs.returncode == 0, logs.stderr
    assert logs.stdout.splitlines() == ["early base mid", "late"]
    marks = next(server.home.rglob(f"{alice_run}/attempt_0/node_0.log.times"))
    data = marks.with_suffix("").read_bytes()
    rows = [[int(v) for v in line.split()] for line in marks.read_text().splitlines()]
    late_at = data.index(b"late")
    marks.write_text("".join(f"{o} {s - 600 if o < late_at else s}\n" for o, s in rows))  # early: 10 min ago
    assert server.air("alice", "logs", alice_run, "--minutes", "5").stdout.splitlines() == ["late"]
    assert server.air("alice", "logs", alice_run, "--minutes", "15").stdout.splitlines() == ["early base mid", "late"]
