"""Every file of the invalid-YAML corpus through the real CLI: exit 2, the field path, nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest

from air.cli.main import main

CORPUS = sorted((Path(__file__).parent.parent / "workload" / "invalid").glob("*.y*ml"))


def _expectation(path: Path) -> str:
    first = path.read_text().splitlines()[0]
    assert first.startswith("# expect:"), path
    return first.split(":", 1)[1].strip()


def test_corpus_is_large_enough() -> None:
    assert len(CORPUS) >= 30


@pytest.mark.parametrize("path", CORPUS, ids=[p.name for p in CORPUS])
def test_invalid_workload_exits_2_names_the_field_and_writes_nothing(
        path: Path, air_home: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIR_TEST_SURELY_UNSET_VARIABLE", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "-f", str(path)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert _expectation(path) in err
    assert path.name in err or "No workload" in err
    assert not (air_home / "runs").exists() or not any((air_home / "runs").iterdir())
    from air.store.run_store import RunStore

    assert RunStore().list_runs(statuses="all") == []
