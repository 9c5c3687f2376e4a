"""`$AIR_HOME/config.yaml`: profiles and base environments, and errors that name the file."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from air.config import load_config, resolve_base_python, resolve_profile
from air.errors import UserInputError


def write_config(air_home: Path, text: str) -> Path:
    air_home.mkdir(parents=True, exist_ok=True)
    path = air_home / "config.yaml"
    path.write_text(text)
    return path


def test_no_file_means_the_local_profile_and_our_interpreter() -> None:
    config = load_config()
    assert config.default_profile == "local" and config.path is None
    profile = resolve_profile(None)
    assert (profile.name, profile.backend, profile.address) == ("local", "local", None)
    assert resolve_base_python(None) == Path(sys.executable)


def test_profiles_default_and_air_profile(air_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_config(air_home, "default_profile: gpu\nprofiles:\n  gpu: {backend: ray, address: '10.0.0.5:6379'}\n")
    assert resolve_profile(None).name == "gpu"
    assert resolve_profile(None).address == "10.0.0.5:6379"
    assert resolve_profile("local").backend == "local"  # always there, even when not written
    monkeypatch.setenv("AIR_PROFILE", "local")
    assert resolve_profile(None).name == "local"
    assert resolve_profile("gpu").name == "gpu"  # -p wins over AIR_PROFILE


def test_unknown_profile_lists_the_known_ones(air_home: Path) -> None:
    write_config(air_home, "profiles:\n  gpu: {backend: ray}\n")
    with pytest.raises(UserInputError) as info:
        resolve_profile("gpus")
    assert "Known profiles: gpu, local" in str(info.value) and "Did you mean 'gpu'?" in str(info.value)
    assert info.value.exit_code == 2


def test_invalid_config_names_the_file_and_the_field(air_home: Path) -> None:
    path = write_config(air_home, "profiles:\n  gpu: {backend: rey, adress: x}\ndefault_profil: gpu\n")
    with pytest.raises(UserInputError) as info:
        load_config()
    text = str(info.value)
    assert str(path) in text
    assert "profiles.gpu.backend" in text and "profiles.gpu.adress: unknown setting. Did you mean 'address'?" in text
    assert "default_profil: unknown setting. Did you mean 'default_profile'?" in text


def test_default_profile_must_exist_and_yaml_must_parse(air_home: Path) -> None:
    write_config(air_home, "default_profile: nowhere\n")
    with pytest.raises(UserInputError, match="default_profile 'nowhere' is not one of the profiles"):
        load_config()
    write_config(air_home, "profiles: [unclosed\n")
    with pytest.raises(UserInputError, match="is not valid YAML"):
        load_config()


def test_base_environments_by_name(air_home: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    write_config(air_home, f"environments:\n  torch26: {{python: {sys.executable}}}\n  '5': {{python: {venv}}}\n")
    assert resolve_base_python("torch26") == Path(sys.executable)
    assert resolve_base_python(5) == venv / "bin" / "python"  # a venv folder, and an int version
    with pytest.raises(UserInputError) as info:
        resolve_base_python("torch25")
    assert "configured: 5, torch26" in str(info.value) and "environments:" in str(info.value)


def test_base_environment_that_is_not_an_interpreter(air_home: Path) -> None:
    write_config(air_home, "environments:\n  old: {python: /nonexistent/python}\n")
    with pytest.raises(UserInputError, match="not an executable Python interpreter"):
        resolve_base_python("old")
