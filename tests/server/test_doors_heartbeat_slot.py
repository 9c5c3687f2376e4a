"""What root reads of a run's heartbeat slot (issue 34, review N): each node process's slot is a file in a
folder its account may write (it beats into it), and the supervisor, root, reads it every few seconds to see
progress. Bob's node swapped its slot for a FIFO: root's open blocked for good, and with it the loop that
ends a run at its timeout, on a cancel or a hang, so his run held its slots past `timeout_minutes` and
`air cancel` (no run of his is ever stuck like that now: the slot is opened without following a link and
without waiting, and only a regular file counts).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from server_helpers import AirServer


def test_a_fifo_for_a_heartbeat_slot_does_not_stop_the_runs_timeout(isolated_server: AirServer, tmp_path: Path) -> None:
    server = isolated_server
    code = tmp_path / "bob" / "code"
    code.mkdir(parents=True)
    (code / "attack.sh").write_text(textwrap.dedent("""
        rm -f "$AIR_HEARTBEAT_FILE"
        mkfifo "$AIR_HEARTBEAT_FILE"
        echo "slot is a fifo"
        sleep 900
    """))
    spec = tmp_path / "bob" / "wl.yaml"
    spec.write_text(textwrap.dedent("""
        experiment_name: bob-exp
        compute: {accelerator_type: CPU_1xCPU, num_accelerators: 1}
        code_source: {snapshot: {root_path: code}}
        max_retries: 0
        timeout_minutes: 0.25
        command: bash $CODE_SOURCE_PATH/attack.sh
    """))
    run_id = str(server.air_json("bob", "run", "-f", str(spec))["run_id"])
    try:
        status = server.wait_status(run_id, "SUCCESS", "FAILED", "TIMEDOUT", "CANCELED", "INTERNAL_ERROR", timeout=150)
    finally:
        server.air("root", "cancel", run_id)
    logs = server.air("bob", "logs", run_id, "--no-follow").stdout
    assert "slot is a fifo" in logs, logs
    assert status == "TIMEDOUT", (status, logs)
    reason = server.air_json("bob", "get", "run", run_id)
    assert "timeout" in str(reason).lower(), reason
