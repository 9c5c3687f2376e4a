"""Run ids and RunPaths: one place names every file of a run; ids from users are validated."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from air.errors import UserInputError
from air.files import atomic_write_bytes, atomic_write_text
from air.store.paths import (
    RunPaths,
    is_run_id,
    new_run_id,
    parse_run_id_fragment,
)


def test_new_run_ids_are_well_formed_unique_and_dated() -> None:
    ids = {new_run_id() for _ in range(2000)}
    assert len(ids) == 2000
    assert all(is_run_id(i) for i in ids)
    day = time.strftime("%y%m%d", time.gmtime())
    assert all(i.startswith(f"run-{day}-") for i in ids)
    # Sortable by day (within a century: the year has two digits).
    jan_2026, feb_2026, jan_2027 = 1767225600.0, 1769904000.0, 1798761600.0
    assert new_run_id(now=jan_2026) < new_run_id(now=feb_2026) < new_run_id(now=jan_2027)
    assert new_run_id(now=feb_2026).startswith("run-260201-")


@pytest.mark.parametrize("good", ["run-260101-0123abcd", "run-2601", "run-260101-01", "0123ab", "RUN-260101", "r"])
def test_fragments_users_may_type(good: str) -> None:
    assert parse_run_id_fragment(good) == good.lower()


@pytest.mark.parametrize("bad", ["", "run-260101-0123abcd0", "../x", "run_260101", "xyz", "0123abcd9", "'; DROP"])
def test_fragments_that_are_refused(bad: str) -> None:
    with pytest.raises(UserInputError):
        parse_run_id_fragment(bad)


def test_run_paths_names(air_home: Path) -> None:
    paths = RunPaths("run-260101-0123abcd")
    folder = air_home.resolve() / "runs" / "run-260101-0123abcd"
    assert paths.folder == folder
    assert paths.spec == folder / "spec.yaml"
    assert paths.hyperparameters == folder / "hyperparameters.yaml"
    assert paths.command == folder / "command.sh"
    assert paths.supervisor_log == folder / "supervisor.log"
    assert paths.supervisor_pid == folder / "supervisor.pid"
    assert paths.submission == folder / "submission.json"
    assert paths.code == folder / "code"
    assert paths.attempt_dir(2) == folder / "attempt_2"
    assert paths.node_log(1, 3) == folder / "attempt_1" / "node_3.log"
    assert not folder.exists(), "naming a path creates nothing"
    assert "run-260101-0123abcd" in repr(paths)
    with pytest.raises(ValueError):
        paths.node_log(-1, 0)


def test_run_paths_refuse_a_non_id(tmp_path: Path) -> None:
    with pytest.raises(UserInputError):
        RunPaths("../../etc", home=tmp_path)


def test_attempts_and_node_logs_are_discovered_from_disk(tmp_path: Path) -> None:
    paths = RunPaths("run-260101-0123abcd", home=tmp_path)
    assert paths.attempts() == [] and paths.node_logs(0) == {}
    assert paths.create() == paths.folder
    assert stat.S_IMODE(paths.folder.stat().st_mode) == 0o700
    for attempt, nodes in ((0, (0, 1)), (1, (0, 1)), (10, (0,))):
        paths.create_attempt(attempt)
        for n in nodes:
            paths.node_log(attempt, n).write_text("x\n")
    (paths.attempt_dir(1) / "node_x.log").write_text("")  # not ours: ignored
    (paths.folder / "attempt_tmp").mkdir()
    assert paths.attempts() == [0, 1, 10]
    assert paths.node_logs(1) == {0: paths.node_log(1, 0), 1: paths.node_log(1, 1)}


def test_atomic_write_replaces_whole_files_and_leaves_no_temporaries(tmp_path: Path) -> None:
    target = tmp_path / "deep" / "spec.yaml"
    atomic_write_text(target, "a: 1\n")
    assert target.read_text() == "a: 1\n"
    atomic_write_bytes(target, b"a: 2\n", mode=0o600)
    assert target.read_bytes() == b"a: 2\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    atomic_write_text(target, "#!/bin/sh\n", mode=0o755, durable=False)  # a scratch file: no fsync
    assert target.read_text() == "#!/bin/sh\n" and stat.S_IMODE(target.stat().st_mode) == 0o755
    assert os.listdir(target.parent) == ["spec.yaml"]


def test_atomic_write_failure_keeps_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "spec.yaml"
    target.write_text("old\n")
    with pytest.raises(TypeError):
        atomic_write_bytes(target, "not bytes")  # type: ignore[arg-type]
    assert target.read_text() == "old\n"
    assert os.listdir(tmp_path) == ["spec.yaml"]
