"""Which files a snapshot ships: the way git sees them, inside and outside a repository."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from air.errors import UserInputError
from air.workload.snapshot import plan_snapshot
from air.workload.snapshot_store import materialize_snapshot


def test_git_ships_tracked_and_untracked_not_ignored(repo: Path, git, write) -> None:
    write(
        repo,
        {
            "new_module.py": "x = 1\n",  # untracked, not ignored → shipped
            "run.log": "noise\n",  # ignored by *.log
            "data/big.bin": "0" * 100,  # ignored folder
            "pkg/._model.py": "mac resource fork\n",
        },
    )
    (repo / "pkg/README.md").unlink()  # tracked but deleted → skipped
    (repo / "train.py").write_text("print('edited')\n")

    plan = plan_snapshot(repo)

    assert plan.files == (".gitignore", "new_module.py", "pkg/model.py", "train.py")
    assert plan.file_count == 4
    sizes = {p: (repo / p).stat().st_size for p in plan.files}
    assert plan.total_bytes == sum(sizes.values())
    assert plan.source == "worktree"
    assert plan.git is not None
    assert plan.git.commit == git(repo, "rev-parse", "HEAD")
    assert plan.git.branch == "main"
    assert plan.git.dirty is True
    assert plan.git.repo_root == repo.resolve()


def test_clean_repo_is_not_dirty(repo: Path) -> None:
    plan = plan_snapshot(repo)
    assert plan.git is not None and plan.git.dirty is False
    assert plan.to_dict()["git"]["dirty"] is False


def test_subfolder_of_a_repo_ships_only_that_subtree(repo: Path, write) -> None:
    write(repo, {"pkg/untracked.py": "y = 2\n", "pkg/debug.log": "x\n"})
    plan = plan_snapshot(repo / "pkg")
    assert plan.name == "pkg"
    assert plan.files == ("README.md", "model.py", "untracked.py")
    assert plan.git is not None and plan.git.subdir == "pkg"


def test_outside_git_nested_gitignore_with_negation(tmp_path: Path, write) -> None:
    root = tmp_path / "plain"
    write(
        root,
        {
            ".gitignore": "*.log\n/build/\ncache\n",
            "main.py": "",
            "a.log": "",
            "build/out.o": "",
            "src/build/keep.txt": "",  # /build/ is anchored to the top: this one stays
            "src/.gitignore": "!important.log\n*.tmp\n",
            "src/important.log": "",  # re-included by the nested .gitignore
            "src/other.log": "",  # still ignored by the parent
            "src/x.tmp": "",
            "src/deep/y.tmp": "",  # nested rules apply to the whole subtree
            "src/deep/ok.py": "",
            "lib/cache/blob": "",  # `cache` matches folders at any depth
            "lib/._hidden": "",
        },
    )
    (root / ".git").write_text("gitdir: /nowhere\n")  # a stray .git entry is never shipped

    plan = plan_snapshot(root)

    assert plan.git is None
    assert plan.files == (
        ".gitignore",
        "main.py",
        "src/.gitignore",
        "src/build/keep.txt",
        "src/deep/ok.py",
        "src/important.log",
    )


def test_outside_git_excluded_folder_cannot_be_reincluded(tmp_path: Path, write) -> None:
    # git: "It is not possible to re-include a file if a parent directory of that file is excluded."
    root = tmp_path / "plain"
    write(root, {".gitignore": "logs/\n!logs/keep.txt\n", "logs/keep.txt": "", "a.py": ""})
    assert plan_snapshot(root).files == (".gitignore", "a.py")


def test_include_paths_restrict(repo: Path, write) -> None:
    write(repo, {"configs/a.yaml": "a: 1\n", "configs/b.yaml": "b: 2\n", "notes.txt": ""})
    plan = plan_snapshot(repo, include_paths=["./pkg/", "configs/a.yaml"])
    assert plan.files == ("configs/a.yaml", "pkg/README.md", "pkg/model.py")
    assert plan.include_paths == ("configs/a.yaml", "pkg")
    # the key depends on what is included
    assert plan.key != plan_snapshot(repo, include_paths=["pkg"]).key


@pytest.mark.parametrize(
    ("include", "message"),
    [
        (["../other"], "must not contain '..'"),
        (["pkg/../../x"], "must not contain '..'"),
        (["/etc"], "relative"),
        (["missing"], "does not exist"),
        (["run.log"], "ignored"),
        ([], "must not be empty"),
    ],
)
def test_include_paths_rejected(repo: Path, include: list[str], message: str) -> None:
    (repo / "run.log").write_text("x")
    with pytest.raises(UserInputError, match=message):
        plan_snapshot(repo, include_paths=include)


def test_git_commit_takes_the_committed_content(repo: Path, git, tmp_path: Path, write) -> None:
    first = git(repo, "rev-parse", "HEAD")
    (repo / "tool.sh").write_text("#!/bin/sh\necho hi\n")
    (repo / "tool.sh").chmod(0o755)
    os.symlink("pkg/model.py", repo / "model_link.py")
    (repo / "train.py").write_text("print('v2')\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "second")
    second = git(repo, "rev-parse", "HEAD")
    # the working tree now differs from both commits
    write(repo, {"train.py": "print('uncommitted')\n", "scratch.py": "", "pkg/model.py": "W = 99\n"})

    plan = plan_snapshot(repo, git_commit=second[:10])
    assert plan.source == "git"
    assert plan.files == (
        ".gitignore",
        "model_link.py",
        "pkg/README.md",
        "pkg/model.py",
        "tool.sh",
        "train.py",
    )
    assert plan.git is not None and plan.git.commit == second and plan.git.dirty is False
    assert plan.tree == git(repo, "rev-parse", f"{second}^{{tree}}")
    assert plan.total_bytes == sum(int(git(repo, "cat-file", "-s", f"{second}:{p}")) for p in plan.files)

    out = materialize_snapshot(plan, tmp_path / "store")
    assert out.name == "proj"
    assert (out / "train.py").read_text() == "print('v2')\n"
    assert (out / "pkg/model.py").read_text() == "W = 1\n"
    assert not (out / "scratch.py").exists()
    assert os.access(out / "tool.sh", os.X_OK)
    assert os.path.islink(out / "model_link.py") and os.readlink(out / "model_link.py") == "pkg/model.py"

    # the key names the commit's tree, not the working tree: editing files does not change it
    (repo / "train.py").write_text("print('edited again')\n")
    assert plan_snapshot(repo, git_commit=second).key == plan.key
    old = plan_snapshot(repo, git_commit=first)
    assert old.key != plan.key
    assert (materialize_snapshot(old, tmp_path / "store") / "train.py").read_text() == "print('v1')\n"


def test_git_commit_of_a_subfolder(repo: Path, git, tmp_path: Path) -> None:
    commit = git(repo, "rev-parse", "HEAD")
    (repo / "pkg/model.py").write_text("W = 2\n")
    plan = plan_snapshot(repo / "pkg", git_commit=commit, include_paths=["model.py"])
    assert plan.files == ("model.py",)
    out = materialize_snapshot(plan, tmp_path / "store")
    assert out.name == "pkg" and (out / "model.py").read_text() == "W = 1\n"


def test_git_branch_refused_with_uncommitted_changes(repo: Path, git) -> None:
    head = git(repo, "rev-parse", "HEAD")
    (repo / "train.py").write_text("print('dirty')\n")
    with pytest.raises(UserInputError) as info:
        plan_snapshot(repo, git_branch="main")
    text = str(info.value)
    assert "uncommitted changes" in text and "train.py" in text
    assert f"git: {{commit: {head}}}" in text
    assert info.value.exit_code == 2


def test_git_branch_refused_with_untracked_files(repo: Path) -> None:
    (repo / "new.py").write_text("")
    with pytest.raises(UserInputError, match="new.py"):
        plan_snapshot(repo, git_branch="main")


def test_git_branch_ships_that_branch_head(repo: Path, git, tmp_path: Path) -> None:
    git(repo, "checkout", "-q", "-b", "feature")
    (repo / "train.py").write_text("print('feature')\n")
    git(repo, "commit", "-q", "-am", "feature work")
    git(repo, "checkout", "-q", "main")
    (repo / "run.log").write_text("ignored files do not make the tree dirty\n")

    plan = plan_snapshot(repo, git_branch="feature")
    assert plan.git is not None
    assert plan.git.branch == "feature" and plan.git.commit == git(repo, "rev-parse", "feature")
    out = materialize_snapshot(plan, tmp_path / "store")
    assert (out / "train.py").read_text() == "print('feature')\n"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"git_branch": "nope"}, "no local branch 'nope'"),
        ({"git_commit": "deadbeef"}, "not found"),
        ({"git_branch": "main", "git_commit": "abc"}, "not both"),
        ({"git_branch": "--upload-pack=evil"}, "not a valid git branch"),
        ({"git_commit": "abc;rm -rf"}, "not a valid git commit"),
    ],
)
def test_git_options_rejected(repo: Path, kwargs: dict[str, str], message: str) -> None:
    with pytest.raises(UserInputError, match=message):
        plan_snapshot(repo, **kwargs)


def test_git_options_on_a_plain_folder(tmp_path: Path) -> None:
    (tmp_path / "plain").mkdir()
    for kwargs in ({"git_branch": "main"}, {"git_commit": "abc123"}):
        with pytest.raises(UserInputError, match="not inside a git repository"):
            plan_snapshot(tmp_path / "plain", **kwargs)


def test_root_path_must_be_a_folder(tmp_path: Path) -> None:
    with pytest.raises(UserInputError, match="does not exist"):
        plan_snapshot(tmp_path / "missing")
    (tmp_path / "f").write_text("")
    with pytest.raises(UserInputError, match="not a folder"):
        plan_snapshot(tmp_path / "f")


def test_root_path_ignored_by_an_enclosing_repo_is_a_plain_folder(repo: Path, write) -> None:
    write(repo, {"data/raw/a.csv": "1\n", "data/raw/b.log": ""})
    plan = plan_snapshot(repo / "data/raw")
    assert plan.files == ("a.csv", "b.log")  # only its own .gitignore files (none) apply
    assert plan.git is None
    assert any("ignored by the git repository" in n for n in plan.notes)


def test_plan_writes_nothing(repo: Path, tmp_path: Path) -> None:
    before = sorted(p.name for p in tmp_path.iterdir())
    plan = plan_snapshot(repo)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert not plan.path_in(tmp_path / "store").exists()
