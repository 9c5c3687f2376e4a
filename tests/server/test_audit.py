"""Who did it: a real `air server`, real runs submitted and canceled through the real CLI. A canceled
run's reason names who canceled it (`Canceled by alice`, `Canceled by root (admin)` for an admin ending
another's run), and `air server audit` lists token creates and revokes and cancels, never a token."""

from __future__ import annotations

import getpass
import json
import subprocess
from pathlib import Path

from server_helpers import AIR, AirServer


def audit(server: AirServer, *args: str) -> subprocess.CompletedProcess[str]:
    """`air server audit` on the server's machine (its AIR_HOME)."""
    return subprocess.run([*AIR, "server", "audit", *args], env=server.server_env(), capture_output=True,
                          text=True, timeout=60)


def audit_entries(server: AirServer, *args: str) -> list[dict[str, object]]:
    result = audit(server, "--json", *args)
    assert result.returncode == 0, result.stdout + result.stderr
    return list(json.loads(result.stdout)["data"]["entries"])


def test_cancel_reasons_name_who_and_the_audit_log_says_it(server: AirServer, tmp_path: Path) -> None:
    try:
        check_cancels_and_audit(server, tmp_path)
    finally:  # a test that failed half-way leaves no run running
        subprocess.run([*AIR, "cancel", "--all", "-y"], env=server.server_env(), capture_output=True, timeout=300)


def check_cancels_and_audit(server: AirServer, tmp_path: Path) -> None:
    me = f"os:{getpass.getuser()}"
    # The fixture made three tokens at the server's shell: each is in the log, by its OS user.
    made = [e for e in audit_entries(server) if e["action"] == "token.create"]
    assert [(e["actor"], json.loads(str(e["detail"]))["user"]) for e in made] == [
        (me, "alice"), (me, "bob"), (me, "root")]

    mine = server.sleeping_run("alice", tmp_path, "mine")
    other = server.sleeping_run("alice", tmp_path, "other")

    # bob may not cancel alice's run: refused, nothing recorded, the run goes on.
    refused = server.air("bob", "cancel", other)
    assert refused.returncode != 0 and "belongs to alice" in refused.stderr, refused.stderr
    assert server.run_status(other) == "RUNNING"

    # alice cancels her own run; root (an admin) cancels another of hers.
    assert server.air_json("alice", "cancel", mine)["runs"] == [{"run_id": mine, "status": "CANCELED"}]
    assert server.air_json("root", "cancel", other)["runs"] == [{"run_id": other, "status": "CANCELED"}]
    reasons = {run_id: server.api("GET", f"/api/v1/runs/{run_id}", token=server.tokens["alice"])[1]
               ["termination_reason"] for run_id in (mine, other)}
    assert reasons == {mine: "Canceled by alice", other: "Canceled by root (admin)"}
    shown = server.air("alice", "get", "run", other)
    assert "Canceled by root (admin)" in shown.stdout, shown.stdout + shown.stderr
    # Canceling a run that is over already changes nothing and records nothing.
    assert server.air_json("root", "cancel", mine)["runs"] == [{"run_id": mine, "status": "CANCELED"}]
    assert server.api("GET", f"/api/v1/runs/{mine}", token=server.tokens["root"])[1]["termination_reason"] == \
        "Canceled by alice"

    # A token revoked at the server's shell is in the log too.
    dave = server.token_create("dave")
    revoked = subprocess.run([*AIR, "server", "token", "revoke", "dave"], env=server.server_env(),
                             capture_output=True, text=True, timeout=60)
    assert revoked.returncode == 0, revoked.stderr

    entries = audit_entries(server)
    cancels = [(e["actor"], e["target"]) for e in entries if e["action"] == "run.cancel"]
    assert cancels == [("alice", mine), ("root", other)]
    dave_made = [e for e in entries if e["action"] == "token.create" and "dave" in str(e["detail"])]
    assert len(dave_made) == 1 and dave_made[0]["actor"] == me
    dave_id = dave_made[0]["target"]
    assert [(e["actor"], e["target"]) for e in entries if e["action"] == "token.revoke"] == [(me, dave_id)]
    seqs = [int(str(e["seq"])) for e in entries]
    assert seqs == sorted(seqs)  # oldest first, as a log reads

    # --limit: the newest N; the text table names the same things; no token is ever in the log.
    assert [e["action"] for e in audit_entries(server, "--limit", "2")] == ["token.create", "token.revoke"]
    text = audit(server)
    assert text.returncode == 0 and "run.cancel" in text.stdout and other in text.stdout, text.stderr
    for token in (*server.tokens.values(), dave):
        assert token not in text.stdout and token not in json.dumps(entries)
    bad = audit(server, "--limit", "0")
    assert bad.returncode == 2 and "--limit" in bad.stderr, bad.stderr
