"""Snapshot links resolved against the real tree (issue 22): a chain of links that each look fine lexically
but lead out of the snapshot once followed is found, and the rule agrees with the kernel's own resolution."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from air.workload.snapshot import plan_snapshot
from air.workload.snapshot_links import leaving_links, resolves_inside

#: (links of a tree, the ones that lead out of it once every link is followed)
TREES = [
    ({"a/b": "..", "d1/d2/up": "../../a/b/.."}, ["d1/d2/up"]),          # a/b is the root: its '..' is above
    ({"a/b": "..", "up": "a/b/a/b/a/b/.."}, ["up"]),
    ({"a/b": "..", "d1/d2/up": "../../.."}, ["d1/d2/up"]),              # plainly out
    ({"a/b": "..", "c": "a/b/a/b/d"}, []),                              # loops back inside: fine
    ({"lib": "src/pkg", "src/pkg": "../vendor/pkg", "x": "lib/../../.."}, ["x"]),  # lib is vendor/pkg
    ({"x": "y", "y": "x"}, ["x", "y"]),                                 # a cycle never resolves
    ({"abs": "/etc/passwd", "ok": "data/file.txt"}, ["abs"]),
    ({"deep/er/link": "../../top.txt", "dot": "./././file"}, []),
]


@pytest.mark.parametrize(("links", "leaving"), TREES)
def test_links_are_followed_through_the_tree(links: dict[str, str], leaving: list[str]) -> None:
    assert leaving_links(links) == leaving


@pytest.mark.parametrize(("links", "leaving"), [t for t in TREES if "abs" not in t[0]])
def test_the_rule_agrees_with_the_kernel(tmp_path: Path, links: dict[str, str], leaving: list[str]) -> None:
    """Build the tree for real inside a sandbox folder and let realpath decide: same answer."""
    root = tmp_path / "sandbox" / "snap"
    root.mkdir(parents=True)
    for path, target in links.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(target, root / path)
    for path in links:
        real = os.path.realpath(root / path)  # a cycle stays unresolved: realpath returns it under root
        kernel_inside = (real == str(root) or real.startswith(f"{root}/")) and not _loops(root / path)
        assert resolves_inside(links, path) == kernel_inside, (path, real)


def _loops(path: Path) -> bool:
    try:
        os.stat(path)
    except OSError as exc:
        return exc.errno == 40  # ELOOP
    return False


def test_a_local_snapshot_notes_a_chained_link_that_leads_out(tmp_path: Path) -> None:
    root = tmp_path / "proj"
    (root / "a").mkdir(parents=True)
    (root / "d1" / "d2").mkdir(parents=True)
    (root / "train.py").write_text("print('hi')\n")
    os.symlink("..", root / "a" / "b")
    os.symlink("../../a/b/..", root / "d1" / "d2" / "up")
    os.symlink("train.py", root / "main.py")
    notes = plan_snapshot(root).notes
    assert [n for n in notes if "outside the snapshot" in n] == ["d1/d2/up is a link to ../../a/b/.., which is "
                                                                 "outside the snapshot"], notes
