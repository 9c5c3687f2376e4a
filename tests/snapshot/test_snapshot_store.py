"""The content-addressed snapshot store: copied once per key, atomically, safe between processes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from air.home import air_home
from air.workload.snapshot import plan_snapshot
from air.workload.snapshot_store import materialize_snapshot, prune_snapshots


def _keys(store: Path) -> list[str]:
    return sorted(p.name for p in store.iterdir())


def test_unchanged_tree_same_key_and_copied_once(repo: Path, tmp_path: Path) -> None:
    store = tmp_path / "store"
    first = plan_snapshot(repo)
    out = materialize_snapshot(first, store)
    assert out == store / first.key / "proj" == first.path_in(store)
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) == list(first.files)
    assert (out / "train.py").read_text() == "print('v1')\n"
    stat_before = (out / "train.py").stat()

    second = plan_snapshot(repo)
    assert second.key == first.key
    assert materialize_snapshot(second, store) == out
    stat_after = (out / "train.py").stat()
    assert (stat_after.st_ino, stat_after.st_mtime_ns) == (stat_before.st_ino, stat_before.st_mtime_ns)
    assert _keys(store) == [first.key]

    (repo / "train.py").write_text("print('v2')\n")
    changed = plan_snapshot(repo)
    assert changed.key != first.key
    assert (materialize_snapshot(changed, store) / "train.py").read_text() == "print('v2')\n"
    assert _keys(store) == sorted([first.key, changed.key])


def test_key_covers_modes_and_folder_name(tmp_path: Path, write) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    write(a, {"run.sh": "echo\n"})
    write(b, {"run.sh": "echo\n"})
    key_a = plan_snapshot(a).key
    assert plan_snapshot(b).key != key_a  # the folder name is part of what is shipped
    (a / "run.sh").chmod(0o755)
    assert plan_snapshot(a).key != key_a


def test_default_store_is_under_air_home(repo: Path) -> None:
    out = materialize_snapshot(plan_snapshot(repo))
    assert out.parent.parent == air_home() / "snapshots"


def test_symlinks_are_kept_as_links(tmp_path: Path, write) -> None:
    root = tmp_path / "code"
    write(root, {"real/data.txt": "payload\n"})
    os.symlink("real", root / "alias")  # a link to a folder is shipped as a link, not its content
    os.symlink("/etc/hostname", root / "outside")
    plan = plan_snapshot(root)
    assert plan.files == ("alias", "outside", "real/data.txt")
    assert any("outside" in n for n in plan.notes)
    out = materialize_snapshot(plan, tmp_path / "store")
    assert os.readlink(out / "alias") == "real"
    assert os.readlink(out / "outside") == "/etc/hostname"
    assert (out / "alias" / "data.txt").read_text() == "payload\n"


def test_file_changed_after_planning_is_filed_under_its_real_key(tmp_path: Path, write) -> None:
    root = tmp_path / "code"
    write(root, {"a.py": "1\n", "b.py": "2\n"})
    plan = plan_snapshot(root)
    (root / "a.py").write_text("changed\n")
    out = materialize_snapshot(plan, tmp_path / "store")
    assert (out / "a.py").read_text() == "changed\n"
    assert out.parent.name == plan_snapshot(root).key != plan.key
    # the stale plan again: its build lands on a key that exists, so the existing copy is used
    inode = (out / "a.py").stat().st_ino
    assert materialize_snapshot(plan, tmp_path / "store") == out
    assert (out / "a.py").stat().st_ino == inode
    assert _keys(tmp_path / "store") == [out.parent.name]


_RACER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from air.workload.snapshot import plan_snapshot
    from air.workload.snapshot_store import materialize_snapshot

    root, store, go = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    plan = plan_snapshot(root)
    print("ready", flush=True)
    while not go.exists():
        time.sleep(0.001)
    print(materialize_snapshot(plan, store), flush=True)
    """
)


def test_two_processes_materialising_the_same_key_end_with_one_copy(tmp_path: Path, write) -> None:
    root = tmp_path / "code"
    write(root, {f"pkg/m{i:03d}.py": f"x = {i}\n" * 200 for i in range(300)})
    store, go = tmp_path / "store", tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RACER, str(root), str(store), str(go)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    for proc in procs:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    go.touch()  # both have planned; now they copy at the same time
    outs = []
    for proc in procs:
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0
        outs.append(out.strip())

    key = plan_snapshot(root).key
    assert outs == [str(store / key / "code")] * 2
    assert _keys(store) == [key]  # one copy, no temporary folder left behind
    copied = sorted(p.relative_to(store / key / "code").as_posix() for p in (store / key).rglob("*.py"))
    assert copied == [f"pkg/m{i:03d}.py" for i in range(300)]


def test_prune_removes_unused_snapshots(tmp_path: Path, write) -> None:
    store = tmp_path / "store"
    roots = []
    for name in ("old", "new"):
        write(tmp_path / name, {"a.py": name})
        roots.append(tmp_path / name)
    old = materialize_snapshot(plan_snapshot(roots[0]), store).parent
    new = materialize_snapshot(plan_snapshot(roots[1]), store).parent
    stale_tmp = store / ".tmp-abandoned"
    stale_tmp.mkdir()
    now = time.time()
    ten_days_ago = now - 10 * 86400
    for path in (old, stale_tmp):
        os.utime(path, (ten_days_ago, ten_days_ago))

    assert prune_snapshots(7, store, now=now) == sorted([stale_tmp, old])
    assert _keys(store) == [new.name]

    # using a snapshot again marks it as used, so it survives the next prune
    os.utime(new, (ten_days_ago, ten_days_ago))
    materialize_snapshot(plan_snapshot(roots[1]), store)
    assert prune_snapshots(7, store, now=time.time()) == []
