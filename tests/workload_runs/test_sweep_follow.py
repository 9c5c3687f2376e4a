"""A sweep's `--watch` and `air subscribe` follow its children (issue 35): a line (a STATUS event) per child
state change and each child's lines prefixed with its task (carrying `task` and `run_id`), a child's end after
its last lines, the sweep's own end after its children's. Real sweeps of 3 through the real CLI."""

from __future__ import annotations

import json
import re
from pathlib import Path

from runs_helpers import air, air_following, submit, wait_for_gate, write_workload

#: A sweep's children start one after another on 2 loaded cores: generous.
SWEEP_TIMEOUT_S = 420


def sweep_of_3(folder: Path) -> tuple[Path, Path]:
    """The sweep's workload, and the folder of its gates: each task prints its first line, then waits until the
    test has seen it RUNNING and made `<gates>/go-<task>`, so a follower that polls sees that state however
    slow the machine."""
    gates = folder / "gates"
    gates.mkdir()
    return write_workload(folder, "three", f"""\
        experiment_name: sweep-follow
        compute: {{num_accelerators: 1, accelerator_type: CPU_1xCPU}}
        max_retries: 0
        for_each:
          items: [{{x: 1}}, {{x: 2}}, {{x: 3}}]
          max_concurrent: 2
        command: |
          echo "first-$AIR_SWEEP_INDEX"
          {wait_for_gate(f"{gates}/go-$AIR_SWEEP_INDEX")}
          echo "last-$AIR_SWEEP_INDEX"
        """), gates


def children_of(parent: str) -> dict[int, str]:
    got = air("get", "run", parent, "--json")
    assert got.returncode == 0, got.stderr
    tasks = json.loads(got.stdout)["data"]["sweep"]["tasks"]
    return {int(t["index"]): str(t["run_id"]) for t in tasks}


def test_watch_shows_each_childs_states_and_prefixed_lines(tmp_path: Path) -> None:
    path, gates = sweep_of_3(tmp_path)

    def open_gate(line: str) -> None:  # a task goes on to its last line once its RUNNING has been shown
        shown = re.fullmatch(r"\[run-\S+\] task (\d+) run-\S+: RUNNING", line)
        if shown:
            (gates / f"go-{shown.group(1)}").touch()

    # stdout (the lines) and stderr (the states) in one pipe: the order they were written in
    watched = air_following("run", "-f", str(path), "--watch", on_line=open_gate, timeout=SWEEP_TIMEOUT_S,
                            stderr_too=True)
    assert watched.returncode == 0, watched.stdout
    found = re.search(r"Submitted run (run-\S+)", watched.stdout)
    assert found, watched.stdout
    parent = found.group(1)
    children = children_of(parent)
    assert sorted(children) == [0, 1, 2]
    lines = watched.stdout.splitlines()
    for index, child in children.items():
        first, last = f"[task {index}] first-{index}", f"[task {index}] last-{index}"
        assert first in lines and last in lines, watched.stdout
        states = [line for line in lines if line.startswith(f"[{parent}] task {index} {child}: ")]
        assert f"[{parent}] task {index} {child}: RUNNING" in states, watched.stdout
        assert states[-1] == f"[{parent}] task {index} {child}: SUCCESS", watched.stdout
        assert len(states) == len(set(states)), states  # a line per change, not per poll
        assert lines.index(first) < lines.index(last) < lines.index(states[-1])  # its end after its last line
    ended = lines.index(f"[{parent}] ended SUCCESS after " + lines[-1].split(" after ", 1)[1])
    assert ended == len(lines) - 1 and lines.index(f"[{parent}] SUCCESS") > max(
        i for i, line in enumerate(lines) if line.startswith("[task ")), watched.stdout


def test_subscribe_shows_each_childs_states_and_lines(tmp_path: Path) -> None:
    path, gates = sweep_of_3(tmp_path)
    parent = submit(path)

    def open_gate(line: str) -> None:  # a task goes on to its last line once its RUNNING has been shown
        event = json.loads(line)
        if event.get("type") == "STATUS" and event.get("status") == "RUNNING" and "task" in event:
            (gates / f"go-{event['task']}").touch()

    subscribed = air_following("subscribe", parent, "--no-default-metrics", on_line=open_gate,
                               timeout=SWEEP_TIMEOUT_S)
    assert subscribed.returncode == 0, subscribed.stdout + subscribed.stderr
    events = [json.loads(line) for line in subscribed.stdout.splitlines()]
    children = children_of(parent)
    for index, child in children.items():
        mine = [e for e in events if e.get("task") == index]
        assert mine and all(e["run_id"] == child for e in mine), mine
        states = [e["status"] for e in mine if e["type"] == "STATUS"]
        assert "RUNNING" in states and states[-1] == "SUCCESS", states
        assert len(states) == len(set(states)), states
        logs = [e["line"] for e in mine if e["type"] == "LOG"]
        assert logs == [f"first-{index}", f"last-{index}"], logs
        assert all(e["node"] == 0 for e in mine if e["type"] == "LOG")
        # its end state after its last line
        assert mine.index(next(e for e in mine if e.get("status") == "SUCCESS")) > mine.index(
            next(e for e in mine if e.get("line") == f"last-{index}"))
    parent_events = [e for e in events if "task" not in e]
    assert parent_events[-1]["type"] == "TERMINAL" and parent_events[-1]["status"] == "SUCCESS"
    assert events[-1]["type"] == "TERMINAL"  # the sweep's end after every child's
