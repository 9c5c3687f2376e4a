"""Where the test suite's CPU goes (issue 35: `make test` is CPU-bound on CI's 2 cores), per test, with
every process a test starts counted (servers, supervisors, Ray and Slurm nodes, whatever their session).

A pytest plugin: each pytest-xdist worker moves itself into a cgroup v1 `cpuacct` group of its own (root, as
on this project's machines), so everything its tests start stays there; each test's CPU is the group's
usage across its setup, call and teardown. Shared fixtures are counted in the test that started them.

    PYTHONPATH=benchmarks SUITE_CPU_OUT=/tmp/suite-cpu.jsonl \\
        .venv/bin/python -m pytest -p suite_cpu -n 3 --dist loadgroup -m "not gpu" --ignore=tests/lean tests
    .venv/bin/python benchmarks/suite_cpu.py /tmp/suite-cpu.jsonl     # CPU by folder, module and test
    .venv/bin/python benchmarks/suite_cpu.py /tmp/suite-cpu.jsonl timeline    # cores used, minute by minute
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

CPUACCT = Path("/sys/fs/cgroup/cpuacct")
_group: Path | None = None


def pytest_configure(config: Any) -> None:
    global _group
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None and getattr(config.option, "numprocesses", None):
        return  # xdist's controller runs no test
    _group = CPUACCT / f"air-suite-cpu-{os.getpid()}"
    _group.mkdir(exist_ok=True)
    (_group / "cgroup.procs").write_text(str(os.getpid()))


def pytest_unconfigure(config: Any) -> None:
    """Back to the root group; the worker's group goes once nothing is left in it."""
    if _group is not None:
        (CPUACCT / "cgroup.procs").write_text(str(os.getpid()))
        try:
            _group.rmdir()
        except OSError:  # a process of a test still runs (the suite's own checks report it)
            pass


def _usage() -> float:
    assert _group is not None
    return int((_group / "cpuacct.usage").read_text()) / 1e9


try:
    import pytest

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item: Any, nextitem: Any) -> Generator[None, None, None]:
        if _group is None:
            yield
            return
        cpu, wall = _usage(), time.monotonic()
        yield
        row = {"id": item.nodeid, "cpu": round(_usage() - cpu, 2), "wall": round(time.monotonic() - wall, 2),
               "worker": os.environ.get("PYTEST_XDIST_WORKER", ""), "end": round(time.time(), 1)}
        with open(os.environ.get("SUITE_CPU_OUT", "suite-cpu.jsonl"), "a") as out:
            out.write(json.dumps(row) + "\n")
except ImportError:  # the report alone, without pytest
    pass


def report(path: Path, top: int = 25) -> None:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    print(f"{len(rows)} tests: {sum(r['cpu'] for r in rows) / 60:.1f} CPU-minutes, "
          f"{sum(r['wall'] for r in rows) / 60:.1f} worker-minutes")
    for title, key in (("folder", lambda f: f.rsplit("/", 1)[0] if f.count("/") > 1 else f), ("module", str)):
        totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
        for row in rows:
            entry = totals[key(row["id"].split("::")[0])]
            entry[0] += row["cpu"]
            entry[1] += row["wall"]
            entry[2] += 1
        print(f"\nCPU seconds by {title}:")
        for name, (cpu, wall, count) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]:
            print(f"{cpu:8.0f}  wall {wall:6.0f}  {int(count):4d} tests  {name}")
    print("\nCPU seconds by test:")
    for row in sorted(rows, key=lambda r: -r["cpu"])[:top]:
        print(f"{row['cpu']:8.1f}  wall {row['wall']:6.1f}  {row['id']}")


def timeline(path: Path, step_s: float = 60.0) -> None:
    """Per minute of the run: how many workers ran a test and how many cores their tests kept busy (each
    test's CPU spread evenly over its wall time), to see where the cores sat idle (the run's tail)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "end" in r and r.get("worker")]
    if not rows:
        print("no rows with end times (older output)")
        return
    start = min(r["end"] - r["wall"] for r in rows)
    finish = max(r["end"] for r in rows)
    slots = int((finish - start) // step_s) + 1
    busy = [0.0] * slots
    cores = [0.0] * slots
    for row in rows:
        begin, end = row["end"] - row["wall"] - start, row["end"] - start
        rate = row["cpu"] / row["wall"] if row["wall"] > 0 else 0.0
        for slot in range(int(begin // step_s), int(end // step_s) + 1):
            overlap = min(end, (slot + 1) * step_s) - max(begin, slot * step_s)
            if overlap > 0:
                busy[slot] += overlap / step_s
                cores[slot] += overlap * rate / step_s
    print(f"\nminute  workers busy  cores used   (run of {(finish - start) / 60:.1f} min)")
    for slot in range(slots):
        print(f"{slot:6d}  {busy[slot]:12.2f}  {cores[slot]:10.2f}")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[2] == "timeline":
        timeline(Path(sys.argv[1]))
        sys.exit(0)
    report(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("suite-cpu.jsonl"))
