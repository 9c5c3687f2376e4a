"""A server run's dependencies stay inside its code snapshot (issue 34): air.environments.Confinement.

Every local path a dependency line can name (`-r`, `-c`, `-e`, `-f`, a wheel or folder, `file:` and
`git+file:` URLs, an index that is a folder), through symlinks and nested `-r` files, is refused when it
leaves the snapshot, with a message that names the entry and quotes nothing of the file; `$VAR`s expand from
the run's variables only. Without a server, a line of a file outside the workload's folder is never quoted.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from air.environments import Confinement, environment_key, list_environments, parse_dependencies
from air.environments.layout import ACCOUNTS, COMPLETE, envs_dir
from air.errors import UserInputError

SECRET_LINE = "root:$6$not-a-real-hash:19000:0:99999:7:::"


@pytest.fixture
def snapshot(tmp_path: Path) -> Path:
    """A snapshot with a requirements file, a package folder, and links that point in and out of it."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "shadow").write_text(SECRET_LINE + "\n")
    (outside / "pkg").mkdir()
    snap = tmp_path / "snap"
    (snap / "pkg").mkdir(parents=True)
    (snap / "pkg" / "pyproject.toml").write_text('[project]\nname = "inside"\nversion = "1"\n')
    (snap / "requirements.txt").write_text("requests\n-e ./pkg\n")
    (snap / "escape.txt").write_text(f"-r {outside / 'shadow'}\n")
    (snap / "out").symlink_to(outside)
    (snap / "in").symlink_to("pkg")
    return snap


def _refused(entries: list[str], snap: Path, **variables: str) -> str:
    with pytest.raises(UserInputError) as caught:
        parse_dependencies(entries, snap, confine=Confinement(snap, variables))
    message = caught.value.message + (caught.value.hint or "")
    assert SECRET_LINE not in message and "root:" not in message, message
    return message


@pytest.mark.parametrize("entry", [
    "-r {out}/shadow", "-c {out}/shadow", "--constraint={out}/shadow", "-e {out}/pkg", "--find-links {out}",
    "-f file://{out}", "--index-url {out}", "--extra-index-url file://{out}", "{out}/pkg", "x @ file://{out}/pkg",
    "git+file://{out}/pkg", "./out/shadow.whl", "-r out/shadow", "-e out/pkg", "../outside/pkg",
])
def test_a_path_out_of_the_snapshot_is_refused_naming_the_entry(snapshot: Path, entry: str) -> None:
    written = entry.format(out=snapshot.parent / "outside")
    message = _refused(["numpy", written], snapshot)
    assert f"environment.dependencies[1]: {written!r}" in message, message
    assert "outside this run's code snapshot" in message


def test_a_nested_requirements_file_cannot_lead_out(snapshot: Path) -> None:
    message = _refused(["-r escape.txt"], snapshot)
    assert "escape.txt, line 1" in message and "outside this run's code snapshot" in message, message


def test_paths_inside_the_snapshot_and_links_within_it_are_fine(snapshot: Path) -> None:
    deps = parse_dependencies(["-r requirements.txt", "./in", f"x @ file://{snapshot}/pkg"], snapshot,
                              confine=Confinement(snapshot, {}))
    assert [d.display for d in deps.dependencies] == ["requests", "-e ./pkg", "./in", f"x @ file://{snapshot}/pkg"]
    assert all(d.local_path is None or d.local_path.is_relative_to(snapshot) for d in deps.dependencies)


def test_no_snapshot_means_no_local_path(tmp_path: Path) -> None:
    with pytest.raises(UserInputError, match="outside this run's code snapshot"):
        parse_dependencies(["./pkg"], tmp_path, confine=Confinement(None, {}))
    assert parse_dependencies(["numpy"], tmp_path, confine=Confinement(None, {})).lines() == ["numpy"]


def test_variables_come_from_the_run_not_the_servers_environment(snapshot: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SERVER_ONLY_TOKEN", "s3cr3t")
    message = _refused(["--index-url https://${SERVER_ONLY_TOKEN}@example.org/simple"], snapshot)
    assert "SERVER_ONLY_TOKEN" in message and "s3cr3t" not in message
    deps = parse_dependencies(["--index-url https://${TOKEN}@example.org/simple"], snapshot,
                              confine=Confinement(snapshot, {"TOKEN": "run-token"}))
    assert deps.options[0].value == "https://run-token@example.org/simple"
    assert deps.options[0].display == "--index-url https://${TOKEN}@example.org/simple"


def test_locally_a_file_outside_the_workload_folder_is_not_quoted(tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "passwd").write_text(SECRET_LINE + "\n")
    workload = tmp_path / "workload"
    workload.mkdir()
    with pytest.raises(UserInputError) as caught:
        parse_dependencies([f"-r {outside / 'passwd'}"], workload)
    assert SECRET_LINE not in caught.value.message and "line 1" in caught.value.message, caught.value.message
    # the workload's own file is still quoted, so a typo is easy to find
    (workload / "requirements.txt").write_text("numpy&&\n")
    with pytest.raises(UserInputError, match="numpy&&"):
        parse_dependencies(["-r requirements.txt"], workload)


def test_a_huge_requirements_file_is_refused(snapshot: Path) -> None:
    with open(snapshot / "big.txt", "w") as fh:
        fh.write("numpy\n" * 800_000)
    message = _refused(["-r big.txt"], snapshot)
    assert "larger than 4 MiB" in message


def test_env_list_shows_a_servers_per_account_environments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIR_HOME", str(tmp_path / "home"))
    own = envs_dir() / ACCOUNTS / "air-x-bob" / "0123456789abcdef"
    own.mkdir(parents=True)
    (own / COMPLETE).write_text("0123456789abcdef")
    (envs_dir() / ACCOUNTS / "air-x-bob" / ".uv-cache").mkdir()
    [info] = list_environments()
    assert info.path == own and info.state == "ready" and not info.in_use
    assert os.path.exists(envs_dir() / ".locks" / "air-x-bob.0123456789abcdef.lock")


def test_the_same_code_in_another_snapshot_has_the_same_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each server run gets its own snapshot folder: a local package of the same content keys the same (the
    next run reuses the environment), an edited one or an editable install (which points at its folder) not."""
    monkeypatch.setenv("AIR_HOME", str(tmp_path / "home"))
    snaps = []
    for name in ("run1", "run2", "run3"):
        pkg = tmp_path / name / "code" / "pkg"
        pkg.mkdir(parents=True)
        (pkg / "pyproject.toml").write_text('[project]\nname = "p"\nversion = "1"\n')
        (pkg / "p.py").write_text("X = 1\n" if name != "run3" else "X = 2\n")
        snaps.append(pkg.parent)

    def key(snap: Path, entry: str) -> str:
        return environment_key(parse_dependencies([entry], snap, confine=Confinement(snap, {})), sys.executable)

    assert key(snaps[0], "./pkg") == key(snaps[1], "./pkg")
    assert key(snaps[0], "./pkg") != key(snaps[2], "./pkg")  # other content
    assert key(snaps[0], "-e ./pkg") != key(snaps[1], "-e ./pkg")  # the environment points at its folder
