"""Walls between users for `@distributed(..., remote=True)`: a call's ranks, like a workload's nodes, run
as the caller's own Unix account in a bubblewrap view, reach nothing of the server's state, and still hand
every rank's value back to the caller."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from server_helpers import AIR, AirServer

SCRIPT = textwrap.dedent("""
    import json, os, pwd, sys
    from air import distributed

    HOME = sys.argv[1]

    @distributed(num_accelerators=2, accelerator_type="CPU_1xCPU", remote=True)
    def probe():
        tried = {}
        for name in ("runs.db", "server/users/alice/secrets.json", "server/users/bob/secrets.json"):
            try:
                with open(os.path.join(HOME, name), "rb") as fh:
                    tried[name] = "READ %d bytes" % len(fh.read())
            except OSError as exc:
                tried[name] = type(exc).__name__
        return {"rank": int(os.environ["RANK"]), "user": pwd.getpwuid(os.getuid()).pw_name, "tried": tried}

    print("RESULT " + json.dumps(probe.distributed()))
""")


def test_a_remote_call_runs_walled_in_as_its_callers_account(isolated_server: AirServer, tmp_path: Path) -> None:
    server = isolated_server
    secret = subprocess.run([*AIR, "secrets", "put", "hf", "token"], input="bob-secret-value\n",
                            env=server.env("bob"), capture_output=True, text=True, timeout=120)
    assert secret.returncode == 0, secret.stderr
    script = tmp_path / "call.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(server.home)], env=server.env("alice"),
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT "))
    ranks = json.loads(line.removeprefix("RESULT "))
    assert [r["rank"] for r in ranks] == [0, 1]
    for rank in ranks:
        assert rank["user"] == server.account("alice"), rank  # never the server's account (root)
        assert all(not got.startswith("READ") for got in rank["tried"].values()), rank
    runs = server.air_json("alice", "list", "runs", "--all-status")["runs"]
    assert (runs[0]["kind"], runs[0]["status"]) == ("call", "SUCCESS")

