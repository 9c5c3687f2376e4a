"""`air -h config[.path]`: generated from the spec model, so every field is there with its description."""

from __future__ import annotations

import pytest
import yaml
from pydantic import BaseModel

from air.errors import UserInputError
from air.workload.config_help import EXAMPLE, config_help, topics
from air.workload.loading import parse_workload
from air.workload.schema import section_model
from air.workload.spec import WorkloadSpec


def all_fields(model: type[BaseModel] = WorkloadSpec, prefix: str = "") -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = []
    for name, field in model.model_fields.items():
        out.append((f"{prefix}{name}", field))
        child = section_model(field.annotation)
        if child is not None:
            out.extend(all_fields(child, f"{prefix}{name}."))
    return out


def test_overview_lists_every_top_level_field() -> None:
    text = config_help()
    assert text == config_help("config")
    for name in WorkloadSpec.model_fields:
        assert f"  {name} " in text
    assert "experiment_name       string, required" in text
    assert "max_retries           integer, default: 3" in text
    assert "--override" in text and "relative paths resolve against the YAML file's folder" in text


def test_every_field_has_a_description_and_its_own_page() -> None:
    for path, field in all_fields():
        assert getattr(field, "description", None), f"{path} has no description"
        page = config_help(f"config.{path}")
        assert page.startswith(f"config.{path}: ")
        assert field.description.split()[0] in page  # type: ignore[attr-defined]


def test_compute_section() -> None:
    text = config_help("config.compute")
    assert text.startswith("config.compute: section, required")
    assert "num_accelerators  integer, required" in text
    assert "accelerator_type  string, required" in text
    assert "GPU_8xH100" in text and "CPU_" in text
    assert "--override compute.num_accelerators=8" in text
    assert config_help("compute") == text  # the 'config.' prefix is optional


def test_git_section() -> None:
    text = config_help("config.code_source.snapshot.git")
    assert text.startswith("config.code_source.snapshot.git: section, optional")
    assert "branch  string, optional" in text and "commit  string, optional" in text
    assert "commit: 3f2c1ab" in text


def test_leaf_field_page() -> None:
    text = config_help("config.environment.dependencies")
    assert text.startswith("config.environment.dependencies: list of strings, or the path of a requirements file")
    assert "requirements" in text and "Example:" in text


def test_topics_are_the_sections() -> None:
    assert topics() == ["", "compute", "environment", "environment.docker_image", "code_source",
                        "code_source.snapshot", "code_source.snapshot.git", "for_each", "slurm"]


@pytest.mark.parametrize(
    ("path", "phrase"),
    [
        ("config.comptue", "did you mean 'compute'?"),
        ("config.compute.gpus", "renamed to 'compute.num_accelerators'"),
        ("config.code_source.snapshot.gti", "did you mean 'git'?"),
        ("config.env_variables.HF_HOME", "config.env_variables takes any key"),
        ("config.command.x", "config.command has no fields"),
        ("config.", "expected a dotted path"),
    ],
)
def test_unknown_topics(path: str, phrase: str) -> None:
    with pytest.raises(UserInputError) as info:
        config_help(path)
    assert phrase in str(info.value)
    assert info.value.exit_code == 2


def test_the_example_in_the_help_is_a_valid_workload(tmp_path) -> None:  # type: ignore[no-untyped-def]
    spec = parse_workload(yaml.safe_load(EXAMPLE), base_dir=tmp_path)
    assert spec.num_nodes == 2


@pytest.mark.parametrize("path", [f"config.{t}" for t in topics() if t])
def test_section_examples_validate_as_part_of_a_workload(path: str) -> None:
    """Examples in the model must themselves be valid, or the help teaches errors."""
    model = WorkloadSpec
    for key in path.split(".")[1:]:
        field = model.model_fields[key]
        model = section_model(field.annotation)  # type: ignore[assignment]
    assert field.examples
    model.model_validate(field.examples[0])
