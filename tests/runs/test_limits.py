"""The pieces of a run's limits (issue 34), each on real things: cgroups of this machine (made, joined by a
real process before it execs, counted by the kernel, removed), the `server.limits` settings, the reasons'
wording, the disk measure and the blob ledger. The whole, through a real server: tests/server/test_doors_limits.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from air.config import ServerLimits, load_config
from air.errors import UserInputError
from air.launcher.cgroups import (
    JOIN_FAILED,
    Cgroup,
    CgroupError,
    Counters,
    Limits,
    hierarchies,
    join_argv,
    probe,
    server_group,
)
from air.runs.limits import disk_used, limits_at_start, node_cgroup_name
from air.runs.reasons import disk_limit_reason, memory_limit_reason, process_limit_reason, size_text
from air.server.uploads import BlobQuota, BlobQuotaExceeded, ServerPaths
from air.store.run_store import RunStore
from proc_helpers import wait_for


@pytest.fixture
def group(tmp_path: Path) -> Iterator[str]:
    """A server group of this test alone; nothing of it may be left afterwards."""
    name = server_group(tmp_path)
    yield name
    left = [h.mount / name for h in hierarchies().values() if (h.mount / name).exists()]
    assert not left, f"cgroup folders left: {left}"


def test_a_node_joins_its_cgroup_before_its_command_runs_and_the_kernel_counts_it(group: str) -> None:
    """The command's own /proc/self/cgroup names the node's cgroup (it never ran outside it); past the
    memory limit the kernel's OOM killer ends it and counts it; past pids.max forks are refused and counted;
    removal ends what is left and takes the folders (and the empty run and server folders) away."""
    cgroup = Cgroup.plan(f"{group}/run1/attempt_0/node_0", Limits(memory_bytes=100 << 20, pids_max=16))
    cgroup.create()
    try:
        mine = subprocess.run(join_argv(cgroup.procs_files, ["cat", "/proc/self/cgroup"]), capture_output=True,
                              text=True, timeout=60)
        assert mine.returncode == 0, mine.stderr
        assert f"memory:/{group}/run1/attempt_0/node_0" in mine.stdout
        assert f"pids:/{group}/run1/attempt_0/node_0" in mine.stdout
        hog = subprocess.run(join_argv(cgroup.procs_files, [sys.executable, "-c", textwrap.dedent("""
            chunks = []
            for _ in range(30):
                chunks.append(b"x" * (10 << 20))
            print("ALL")
        """)]), capture_output=True, text=True, timeout=120)
        assert hog.returncode == -9 and "ALL" not in hog.stdout
        forks = subprocess.run(join_argv(cgroup.procs_files, ["bash", "-c", "for i in $(seq 40); do sleep 60 >/dev/null 2>&1 & done"]),
                               capture_output=True, text=True, timeout=120)
        assert "fork" in forks.stderr, forks.stderr
        counted = cgroup.counters()
        assert counted.oom_kills == 1 and (counted.pids_refused or 0) > 0
        assert counted.memory_peak is not None and counted.memory_peak <= 100 << 20
        assert cgroup.processes()  # the sleeps bash left behind
    finally:
        cgroup.remove(stop_at=group)
    assert not cgroup.processes()


def test_a_process_that_cannot_join_never_starts_its_command(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    result = subprocess.run(join_argv([str(tmp_path / "no-such-cgroup" / "cgroup.procs")], ["touch", str(marker)]),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == JOIN_FAILED and "could not join the cgroup" in result.stderr
    assert not marker.exists()
    assert join_argv([], ["true"]) == ["true"]


def test_the_probe_says_what_runs_get_and_leaves_nothing(group: str) -> None:
    said = probe(group)
    assert said.startswith("cgroup v") and "memory" in said and "pids" in said


def test_names_are_unique_per_server_run_attempt_and_node(tmp_path: Path) -> None:
    one, other = tmp_path / "a", tmp_path / "b"
    assert server_group(one) != server_group(other) and server_group(one) == server_group(one)
    assert node_cgroup_name(one, "r1", 2, 3) == f"{server_group(one)}/r1/attempt_2/node_3"


def test_server_limits_settings(tmp_path: Path) -> None:
    assert ServerLimits() == ServerLimits(memory_per_node="80%", pids_per_node=4096, disk_per_run="20%",
                                          blob_quota_per_user=2 << 30)
    parsed = ServerLimits(memory_per_node="1.5GiB", pids_per_node=64, disk_per_run="500MB", blob_quota_per_user=None)
    assert (parsed.memory_per_node, parsed.disk_per_run, parsed.blob_quota_per_user) == (3 << 29, 500 * 10**6, None)
    assert ServerLimits.in_bytes("25%", 1000) == 250 and ServerLimits.in_bytes(None, 1000) is None
    config = tmp_path / "config.yaml"
    for bad, said in (({"memory_per_node": "lots"}, "memory_per_node: must be a size such as 200MiB"),
                      ({"blob_quota_per_user": "10%"}, "blob_quota_per_user: must be a size"),
                      ({"pids_per_node": 0}, "pids_per_node"),
                      ({"memory_pernode": "1GiB"}, "Did you mean 'memory_per_node'")):
        config.write_text(textwrap.dedent(f"server:\n  limits: {bad}\n"))
        with pytest.raises(UserInputError) as caught:
            load_config(config)
        assert said in caught.value.message, caught.value.message


def test_limit_reasons_say_which_limit_and_its_size() -> None:
    assert size_text(200 << 20) == "200 MiB" and size_text(4 << 30) == "4 GiB"
    oom = memory_limit_reason(200 << 20, 1, where=" (node 1)")
    assert oom.reason.startswith("Out of memory (node 1): the node ran out of memory at its limit of 200 MiB")
    pids = process_limit_reason(64, 12, "BlockingIOError: [Errno 11] Resource temporarily unavailable")
    assert "limit of 64 processes" in pids.reason and pids.reason.endswith("then: BlockingIOError: [Errno 11] "
                                                                             "Resource temporarily unavailable")
    disk = disk_limit_reason(70 << 20, 60 << 20)
    assert "held 70 MiB, past its bound of 60 MiB" in disk.reason


def test_disk_used_counts_what_is_on_disk(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "f").write_bytes(b"x" * (3 << 20))
    with open(tmp_path / "sparse", "wb") as fh:  # 1 GiB long, nothing written: no disk used
        fh.truncate(1 << 30)
    os.link(tmp_path / "a" / "b" / "f", tmp_path / "hard")  # one file, however many names
    os.symlink("/usr", tmp_path / "link")  # not followed
    used = disk_used([tmp_path])
    assert 3 << 20 <= used < (3 << 20) + (1 << 20)


def test_disk_used_never_enters_a_folder_the_run_swapped_for_a_link(tmp_path: Path) -> None:
    """The run's account writes the watched folders: one it replaces by a link (to / or another run's
    folder) before the walk reaches it is not entered, at the top or below."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "big").write_bytes(b"x" * (3 << 20))
    watched = tmp_path / "scratch"
    watched.mkdir()
    (watched / "checkpoints").symlink_to(elsewhere)  # a folder swapped for a link
    top = tmp_path / "swapped-top"
    top.symlink_to(elsewhere)
    assert disk_used([watched]) < 1 << 20
    assert disk_used([top]) == 0


def test_blob_quota_counts_each_users_uploads(tmp_path: Path) -> None:
    paths = ServerPaths(tmp_path)
    paths.blobs.mkdir(parents=True)
    bob = BlobQuota(paths, "bob", 3 << 20)
    for digest in ("a" * 64, "b" * 64):
        (paths.blobs / digest).write_bytes(b"")
    bob.charge("a" * 64, 2 << 20)
    bob.charge("a" * 64, 2 << 20)  # the same blob twice counts once
    bob.charge("c" * 64, 5 << 20)  # a blob no longer on the server no longer counts
    assert bob.used() == 2 << 20
    bob.take(1 << 20)
    with pytest.raises(BlobQuotaExceeded) as caught:
        BlobQuota(paths, "bob", 3 << 20).take(1)  # another upload of bob's at the same time
    assert caught.value.http_status == 413 and "quota of 3 MiB" in caught.value.message
    alice = BlobQuota(paths, "alice", 3 << 20)
    alice.take(3 << 20)  # alice has her own
    bob.release()
    again = BlobQuota(paths, "bob", 3 << 20)
    again.take(1 << 20)
    for quota in (alice, again):
        quota.release()
    assert (paths.user_blobs("bob").stat().st_mode & 0o777) == 0o600


def test_a_machine_without_the_controllers_is_said_so() -> None:
    with pytest.raises(CgroupError, match="no cgroup hierarchy with the memory, pids controller"):
        Cgroup.plan("air-x/run/attempt_0/node_0", Limits(1 << 30, 64), found={})


def test_the_server_start_says_what_runs_get_and_removes_what_ended_runs_left(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A supervisor killed with -9 leaves its node's cgroup (and a process in it): the next start ends the
    process and removes the folders of runs that have ended, and its banner line names the limits."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.yaml").write_text("server:\n  limits: {memory_per_node: 1GiB, pids_per_node: 100}\n")
    monkeypatch.setenv("AIR_HOME", str(home))
    monkeypatch.setenv("AIR_ISOLATION", "unix-user+bwrap")
    group = server_group(home)
    left = Cgroup.plan(f"{group}/run-gone/attempt_0/node_0", Limits(1 << 30, 100))
    left.create()
    orphan = subprocess.Popen(join_argv(left.procs_files, ["sleep", "600"]), start_new_session=True)
    try:
        wait_for(lambda: orphan.pid in left.processes(), "the orphan to join its cgroup", timeout=30)
        said = limits_at_start(RunStore(home / "runs.db"))
        assert said.startswith("cgroup v") and "memory 1 GiB per node, 100 processes per node" in said, said
        assert "uploaded blobs 2 GiB per user" in said, said
        assert orphan.wait(timeout=30) == -9
        assert not [h.mount / group for h in hierarchies().values() if (h.mount / group).exists()]
    finally:
        if orphan.poll() is None:
            orphan.kill()
        left.remove(stop_at=group)


def test_cgroup_v2_files_on_a_unified_hierarchy(tmp_path: Path) -> None:
    """This machine is cgroup v1: the v2 paths are checked on a folder laid out like a unified hierarchy
    (mountinfo parsed, controllers enabled level by level, memory.max/pids.max written, the counters read
    from memory.events and pids.events)."""
    mount = tmp_path / "cgroup"
    mount.mkdir()
    (mount / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (mount / "cgroup.subtree_control").write_text("")
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(f"35 24 0:30 / {mount} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n")
    found = hierarchies(str(mountinfo))
    assert {name: (h.version, h.mount) for name, h in found.items()} == {c: (2, mount) for c in ("cpu", "memory", "pids")}
    cgroup = Cgroup.plan("air-x/run/attempt_0/node_0", Limits(200 << 20, 64), found=found)
    folder = mount / "air-x" / "run" / "attempt_0" / "node_0"
    for level in (mount / "air-x", mount / "air-x" / "run", mount / "air-x" / "run" / "attempt_0"):
        level.mkdir(parents=True, exist_ok=True)
        (level / "cgroup.subtree_control").write_text("")
    cgroup.create()
    assert cgroup.procs_files == (str(folder / "cgroup.procs"),)  # one folder for every controller
    assert (folder / "memory.max").read_text() == str(200 << 20) and (folder / "memory.swap.max").read_text() == "0"
    assert (folder / "pids.max").read_text() == "64"
    assert (mount / "air-x" / "run" / "cgroup.subtree_control").read_text() == "+cpu"  # (a plain file: the last of memory, pids, cpu)
    (folder / "memory.events").write_text("low 0\nhigh 0\nmax 7\noom 2\noom_kill 2\n")
    (folder / "pids.events").write_text("max 5\n")
    (folder / "memory.peak").write_text(str(190 << 20))
    assert cgroup.counters() == Counters(oom_kills=2, pids_refused=5, memory_peak=190 << 20)
