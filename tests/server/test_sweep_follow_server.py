"""A sweep's `air subscribe` and `air run --watch` through a real `air server` follow its children as on
this machine (issue 35): the CLI merges the parent's stream with each child's, both from the server."""

from __future__ import annotations

import json
import re
from pathlib import Path

from server_helpers import AirServer

SWEEP_TIMEOUT_S = 420

SWEEP = """experiment_name: server-sweep-follow
compute: {num_accelerators: 1, accelerator_type: CPU_1xCPU}
max_retries: 0
for_each:
  items: [{x: 1}, {x: 2}, {x: 3}]
  max_concurrent: 2
command: |
  echo "first-$AIR_SWEEP_INDEX"
  sleep 3
  echo "last-$AIR_SWEEP_INDEX"
"""


def test_subscribe_and_watch_follow_the_children_through_the_server(server: AirServer, tmp_path: Path) -> None:
    spec = tmp_path / "three.yaml"
    spec.write_text(SWEEP)
    parent = str(server.air_json("alice", "run", "-f", str(spec))["run_id"])
    subscribed = server.air("alice", "subscribe", parent, "--no-default-metrics", timeout=SWEEP_TIMEOUT_S)
    assert subscribed.returncode == 0, subscribed.stdout + subscribed.stderr
    events = [json.loads(line) for line in subscribed.stdout.splitlines()]
    tasks = {int(t["index"]): t["run_id"] for t in server.air_json("alice", "get", "run", parent)["sweep"]["tasks"]}
    assert sorted(tasks) == [0, 1, 2]
    for index, child in tasks.items():
        mine = [e for e in events if e.get("task") == index]
        assert mine and all(e["run_id"] == child for e in mine), events
        states = [e["status"] for e in mine if e["type"] == "STATUS"]
        assert states and states[-1] == "SUCCESS", states
        assert [e["line"] for e in mine if e["type"] == "LOG"] == [f"first-{index}", f"last-{index}"], mine
    assert events[-1]["type"] == "TERMINAL" and events[-1]["status"] == "SUCCESS"

    watched = server.air("alice", "run", "-f", str(spec), "--watch", timeout=SWEEP_TIMEOUT_S)
    assert watched.returncode == 0, watched.stdout + watched.stderr
    found = re.search(r"Submitted run (run-\S+)", watched.stdout + watched.stderr)
    assert found, watched.stdout + watched.stderr
    for index in range(3):
        assert f"[task {index}] first-{index}" in watched.stdout and f"[task {index}] last-{index}" in watched.stdout
        assert re.search(rf"\[{found.group(1)}\] task {index} run-\S+: SUCCESS", watched.stderr), watched.stderr
