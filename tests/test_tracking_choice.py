"""The suite's choice of which tests' runs record to MLflow (tests/tracking_choice.py): a test that names
MLflow or tracking in its own code, in a module function it calls, or in a module fixture it takes keeps
tracking on; a test of a module that names it elsewhere only does not."""

from __future__ import annotations

import textwrap
from pathlib import Path

from tracking_choice import _test_names_tracking

MODULE = textwrap.dedent('''\
    import pytest

    def metric_of(run):
        return read_history(run)

    def read_history(run):
        from mlflow import MlflowClient
        return MlflowClient().get_metric_history(run, "loss")

    @pytest.fixture
    def logged_run():
        return "tracking-on"

    def test_plain(air_home):
        assert air_home

    def test_calls_a_helper_that_reads_mlflow(air_home):
        assert metric_of("r")

    def test_takes_a_fixture_that_names_it(logged_run):
        assert logged_run

    @pytest.mark.parametrize("server", ["mlflow"], indirect=True)
    def test_decorated(server):
        assert server

    def test_turns_it_off(monkeypatch):
        monkeypatch.setenv("AIR_TRACKING", "off")

    class TestInAClass:
        def test_method(self):
            pass
''')


def test_a_test_tracks_by_its_own_code_its_helpers_and_its_fixtures(tmp_path: Path) -> None:
    module = tmp_path / "test_example.py"
    module.write_text(MODULE)
    assert _test_names_tracking(module, "test_plain", ("air_home",)) is False
    assert _test_names_tracking(module, "test_calls_a_helper_that_reads_mlflow", ("air_home",)) is True
    assert _test_names_tracking(module, "test_takes_a_fixture_that_names_it", ("logged_run",)) is True
    assert _test_names_tracking(module, "test_decorated", ("server",)) is True
    assert _test_names_tracking(module, "test_turns_it_off", ("monkeypatch",)) is False
    assert _test_names_tracking(module, "test_method", ()) is None  # in a class: the module decides
