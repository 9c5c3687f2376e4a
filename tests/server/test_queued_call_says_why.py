"""A queued `@distributed(remote=True)` call says why it waits (issue 27): through a real `air server`
whose config limits each user to one running run, alice's call waits behind her own workload and its
caller prints the server's reason on stderr instead of staying silent."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

from server_helpers import running_server
from test_server_pools import Runs

from proc_helpers import wait_for

SCRIPT = textwrap.dedent("""
    import json
    from air import distributed

    @distributed(num_accelerators=1, accelerator_type="CPU_1xCPU", remote=True)
    def answer():
        return 42

    print("RESULT " + json.dumps(answer.distributed()), flush=True)
""")


def test_a_queued_remote_call_prints_why_it_waits(tmp_path: Path) -> None:
    with running_server(tmp_path, config="max_running_runs_per_user: 1\n") as server:
        runs = Runs(server, tmp_path / "work")
        held = runs.submit("alice", "holder")
        runs.slot("holder")  # alice's one running run
        script = tmp_path / "call.py"
        script.write_text(SCRIPT)
        caller = subprocess.Popen([sys.executable, str(script)], env=server.env("alice"), cwd=tmp_path,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        err_lines: list[str] = []
        reader = threading.Thread(target=lambda: err_lines.extend(caller.stderr or ()), daemon=True)
        reader.start()
        try:
            wait_for(lambda: any("is queued:" in line for line in err_lines) or caller.poll() is not None,
                     "the caller to say why its call waits", timeout=120)
            said = next((line for line in err_lines if "is queued:" in line), None)
            assert said is not None, "".join(err_lines)
            assert said.startswith("[air] run ") and "alice has 1 of 1 running runs" in said, said
            assert caller.poll() is None  # still waiting: it said so while queued
        finally:
            runs.release("holder")
        out, _ = caller.communicate(timeout=300)
        reader.join(timeout=30)
        assert caller.returncode == 0, out + "".join(err_lines)
        assert json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT ")).removeprefix("RESULT ")) == [42]
        assert sum("is queued:" in line for line in err_lines) == 1  # the reason did not change: said once
        assert server.wait_status(held, "SUCCESS", "FAILED", "CANCELED") == "SUCCESS"
