"""The run page says "node 0 ended; node 1 still running" (issue 27), as curl sees it, over a real 2-node
run whose node 0 exits at once while node 1 waits for a file."""

from __future__ import annotations

import html
import urllib.request
from collections.abc import Callable
from pathlib import Path

from runs_helpers import submit, wait_status, wait_terminal, write_workload

from proc_helpers import wait_for


def page(url: str) -> str:
    with urllib.request.urlopen(url, timeout=60) as response:
        assert response.status == 200
        return html.unescape(response.read().decode())


def test_run_page_says_node_0_ended_while_node_1_runs(
    tmp_path: Path, air_home: Path, cpu_slots: None, serve: Callable[..., str]
) -> None:
    marker = tmp_path / "release"
    run_id = submit(write_workload(tmp_path, "lingering", f"""
        experiment_name: lingering
        compute: {{num_accelerators: 2, accelerator_type: CPU_1xCPU}}
        max_retries: 0
        command: |
          if [ "$NODE_RANK" = 0 ]; then exit 0; fi
          while [ ! -e {marker} ]; do sleep 0.1; done
    """))
    try:
        wait_status(run_id, "RUNNING", timeout=120)
        base = serve()

        def notice() -> str | None:
            text = page(f"{base}/runs/{run_id}")
            return text if 'id="node-ended"' in text else None

        shown = wait_for(notice, "the run page to say node 0 ended", timeout=120)
        assert "node 0 ended " in str(shown) and "node 1 still running" in str(shown)
    finally:
        marker.touch()
    assert wait_terminal(run_id, timeout=120).status.value == "SUCCESS"
    assert 'id="node-ended"' not in page(f"{base}/runs/{run_id}")
