"""A `@distributed` call inside a run of an isolated `air server` (issue 23): the run's node cannot write
the server's store (its account, its bwrap view), and the call still runs on the node's own slots and
returns every rank's result, with nothing written to the server's state."""

from __future__ import annotations

import textwrap
from pathlib import Path

from server_helpers import AirServer

NESTED = textwrap.dedent('''
    from air import distributed

    @distributed(gpus=2, gpu_type="CPU")
    def rank_of() -> int:
        import os
        return int(os.environ["RANK"])

    print("NESTED", rank_of.distributed(), flush=True)
''')


def test_a_nested_call_in_an_isolated_run_uses_its_nodes_slots(isolated_server: AirServer, tmp_path: Path) -> None:
    server = isolated_server
    code = tmp_path / "code"
    code.mkdir()
    (code / "main.py").write_text(NESTED)
    spec = tmp_path / "wl.yaml"
    spec.write_text(textwrap.dedent("""
        experiment_name: nested
        compute: {accelerator_type: CPU_1xCPU, num_accelerators: 2}
        code_source: {snapshot: {root_path: code}}
        max_retries: 0
        command: python $CODE_SOURCE_PATH/main.py
    """))
    before = sorted(p.name for p in (server.home / "runs").iterdir()) if (server.home / "runs").exists() else []
    run_id = str(server.air_json("alice", "run", "-f", str(spec))["run_id"])
    status = server.wait_status(run_id, "SUCCESS", "FAILED", "INTERNAL_ERROR", timeout=300)
    log = (server.home / "runs" / run_id / "attempt_0" / "node_0.log").read_text()
    assert status == "SUCCESS", log
    assert "NESTED [0, 1]" in log, log
    # The call ran on the node's slots: the server's store has only the workload's run.
    after = sorted(p.name for p in (server.home / "runs").iterdir())
    assert sorted(set(after) - set(before)) == [run_id], after
