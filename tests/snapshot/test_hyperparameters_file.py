"""`parameters:` written to the YAML file that HYPERPARAMETERS_PATH points to."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import yaml

from air.errors import UserInputError
from air.workload.parameters import write_parameters


def test_round_trips_through_safe_load(tmp_path: Path) -> None:
    params = {
        "lr": 3e-4,
        "epochs": 10,
        "use_amp": True,
        "optimizer": {"name": "adamw", "betas": [0.9, 0.999], "nested": {"deep": None}},
        "layers": [{"width": 128}, {"width": 64}],
        "tricky": ["yes", "no", "null", "1e3", "0x1F", "012", ".inf", "", "a: b", "- x", "#c", "ünïcode"],
        "date": datetime.date(2024, 1, 2),
        "big": 10**30,
        "long": "x" * 500,
    }
    path = write_parameters(params, tmp_path / "run" / "hyperparameters.yaml")
    assert path == tmp_path / "run" / "hyperparameters.yaml"
    assert yaml.safe_load(path.read_text()) == params
    text = path.read_text()
    assert "'1e3'" in text and "'0x1F'" in text  # YAML 1.2 readers (OmegaConf) must see strings too
    assert text.index("lr") < text.index("epochs")  # the user's order is kept
    assert [p.name for p in path.parent.iterdir()] == ["hyperparameters.yaml"]  # no temporary left


def test_overwrites_atomically(tmp_path: Path) -> None:
    path = tmp_path / "h.yaml"
    write_parameters({"a": 1}, path)
    write_parameters({"b": 2}, path)
    assert yaml.safe_load(path.read_text()) == {"b": 2}


def test_unrepresentable_value_names_its_path(tmp_path: Path) -> None:
    with pytest.raises(UserInputError, match=r"parameters\.model\.layers\[1\]"):
        write_parameters({"model": {"layers": [1, object()]}}, tmp_path / "h.yaml")
    assert not (tmp_path / "h.yaml").exists()


def test_must_be_a_map(tmp_path: Path) -> None:
    with pytest.raises(UserInputError, match="must be a map"):
        write_parameters([1, 2], tmp_path / "h.yaml")  # type: ignore[arg-type]
