"""MLflow's schema migrations run once per user and MLflow version: the first embedded store made is kept
(its Default experiment taken out) as a template in `$XDG_CACHE_HOME/air`, and every later store starts
as its copy. The copy must be the same store a migration makes, with its Default experiment under its own
AIR_HOME; a template the process cannot trust or open is never a reason for a store to fail."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from air.home import AirHome
from air.tracking.store import prepare_store, schema_template


def fresh_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> AirHome:
    """An AIR_HOME of its own (this folder's conftest shares one; a store is made once per home)."""
    monkeypatch.setenv("AIR_HOME", str(tmp_path / name))
    home = AirHome()
    prepare_store(f"sqlite:///{home.mlflow_db}")
    return home


def rows(db: Path, query: str) -> list[tuple[object, ...]]:
    con = sqlite3.connect(db)
    try:
        return con.execute(query).fetchall()
    finally:
        con.close()


def schema(db: Path) -> list[tuple[object, ...]]:
    return rows(db, "SELECT type, name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%' ORDER BY name")


def application_id(db: Path) -> int:
    return int(rows(db, "PRAGMA application_id")[0][0])


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_store_made_from_the_template_is_the_store_a_migration_makes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
    first = fresh_home(tmp_path, monkeypatch, "first")
    template = schema_template()
    assert template.parent == cache / "air" and template.stat().st_mode & 0o777 == 0o600
    assert rows(template, "SELECT experiment_id FROM experiments") == []  # no AIR_HOME's path in it
    # Mark the template, so the next store shows that it began as its copy.
    con = sqlite3.connect(template)
    con.execute("PRAGMA application_id = 4242")
    con.close()

    second = fresh_home(tmp_path, monkeypatch, "second")
    assert application_id(second.mlflow_db) == 4242
    assert application_id(first.mlflow_db) == 0
    assert schema(second.mlflow_db) == schema(first.mlflow_db)
    assert rows(second.mlflow_db, "SELECT * FROM alembic_version") == rows(first.mlflow_db,
                                                                         "SELECT * FROM alembic_version")
    for home in (first, second):
        assert rows(home.mlflow_db, "SELECT experiment_id, name, artifact_location FROM experiments") == [
            (0, "Default", f"{(home.root / 'mlartifacts').as_uri()}/0")]
        assert rows(home.mlflow_db, "PRAGMA journal_mode") == [("wal",)]

    from mlflow import MlflowClient

    made = MlflowClient(f"sqlite:///{second.mlflow_db}").create_experiment("after-the-copy")
    assert made == MlflowClient(f"sqlite:///{first.mlflow_db}").create_experiment("after-the-copy") == "1"


def test_a_template_another_account_could_have_written_is_not_used(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
    fresh_home(tmp_path, monkeypatch, "first")
    template = schema_template()
    con = sqlite3.connect(template)
    con.execute("PRAGMA application_id = 4242")
    con.close()
    template.chmod(0o666)
    second = fresh_home(tmp_path, monkeypatch, "second")
    assert application_id(second.mlflow_db) == 0  # migrated afresh
    assert rows(second.mlflow_db, "SELECT name FROM experiments") == [("Default",)]


def test_a_template_that_does_not_open_is_replaced_and_the_store_still_made(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
    template = schema_template()
    template.parent.mkdir(parents=True)
    template.write_bytes(b"not a database " * 100)
    template.chmod(0o600)
    home = fresh_home(tmp_path, monkeypatch, "home")
    assert rows(home.mlflow_db, "SELECT name FROM experiments") == [("Default",)]
    assert rows(template, "SELECT count(*) FROM alembic_version") == [(1,)]  # a good one in its place
    assert not list(home.root.glob(".mlflow.db.*"))  # no draft left behind


def test_a_cache_that_cannot_be_written_only_costs_the_migrations(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    home = fresh_home(tmp_path, monkeypatch, "home")
    assert rows(home.mlflow_db, "SELECT name FROM experiments") == [("Default",)]
    assert blocker.read_text() == ""
