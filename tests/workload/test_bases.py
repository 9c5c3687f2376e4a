"""`_bases_`: a workload composed from base YAML files (issue 26). Bases merge in order, later ones and
then the file itself winning; mappings merge key by key, lists replace; nested bases resolve against their
own folder; a cycle, a missing base and a composition past the bounds are exit 2 with what to do."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from air.bounds import MAX_BASE_FILES, MAX_BASES_DEPTH
from air.errors import UserInputError
from air.workload.loading import WorkloadSpecError, load_workload, parse_workload


def write(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(body))
    return path


def air(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "air.cli.main", *args], capture_output=True, text=True,
                          timeout=120)


@pytest.fixture
def two_levels(tmp_path: Path) -> Path:
    """train.yaml -> shared/gpu.yaml -> ../common.yaml (two levels of bases, each in its own folder)."""
    (tmp_path / "code").mkdir()
    write(tmp_path / "common.yaml", """\
        compute: {num_accelerators: 1, accelerator_type: CPU_1xCPU}
        code_source: {type: snapshot, snapshot: {root_path: code}}
        env_variables: {A: common, B: common, C: common}
        parameters: {lr: 0.1, layers: [1, 2, 3], optim: {name: sgd, momentum: 0.9}}
        max_retries: 1
        """)
    write(tmp_path / "shared" / "gpu.yaml", """\
        _bases_: [../common.yaml]
        compute: {num_accelerators: 2, accelerator_type: CPU_1xCPU}
        env_variables: {B: gpu}
        parameters: {layers: [7], optim: {name: adam}}
        """)
    return write(tmp_path / "train.yaml", """\
        _bases_: [shared/gpu.yaml]
        experiment_name: composed
        command: echo "$A $B $C"
        env_variables: {C: train}
        """)


def test_two_levels_merge_in_order_and_the_file_wins(two_levels: Path, tmp_path: Path) -> None:
    spec = load_workload(two_levels)
    assert spec.experiment_name == "composed"
    assert spec.compute.num_accelerators == 2 and spec.num_nodes == 2  # gpu.yaml over common.yaml
    assert spec.env_variables == {"A": "common", "B": "gpu", "C": "train"}
    assert spec.parameters == {"lr": 0.1, "layers": [7], "optim": {"name": "adam", "momentum": 0.9}}
    assert spec.max_retries == 1
    # common.yaml's root_path is relative to common.yaml's folder, not to the file that includes it
    assert spec.code_source is not None and spec.code_source.snapshot.root_path == str(tmp_path / "code")
    assert spec.bases == (tmp_path / "common.yaml", tmp_path / "shared" / "gpu.yaml")


def test_later_bases_win_over_earlier_ones(tmp_path: Path) -> None:
    write(tmp_path / "one.yaml", "compute: {num_accelerators: 1, accelerator_type: CPU_1xCPU}\n"
                                 "env_variables: {X: one, Y: one}\n")
    write(tmp_path / "two.yaml", "env_variables: {X: two}\nmax_retries: 0\n")
    path = write(tmp_path / "w.yaml", "_bases_: [one.yaml, two.yaml]\nexperiment_name: e\ncommand: 'true'\n")
    spec = load_workload(path)
    assert spec.env_variables == {"X": "two", "Y": "one"} and spec.max_retries == 0


def test_overrides_win_over_bases(two_levels: Path) -> None:
    spec = load_workload(two_levels, ["env_variables.B=cli", "parameters.optim.name=lamb"])
    assert spec.env_variables["B"] == "cli"
    assert spec.parameters is not None and spec.parameters["optim"] == {"name": "lamb", "momentum": 0.9}


def test_dry_run_shows_the_merged_workload_and_its_bases(two_levels: Path, tmp_path: Path) -> None:
    result = air("run", "-f", str(two_levels), "--dry-run", "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)["data"]["plan"]
    assert plan["bases"] == [str(tmp_path / "common.yaml"), str(tmp_path / "shared" / "gpu.yaml")]
    assert plan["compute"]["num_accelerators"] == 2 and plan["max_retries"] == 1
    assert plan["parameters"] == {"lr": 0.1, "layers": [7], "optim": {"name": "adam", "momentum": 0.9}}
    env = plan["nodes"][0]["env"]
    assert (env["A"], env["B"], env["C"]) == ("common", "gpu", "train")
    text = air("run", "-f", str(two_levels), "--dry-run")
    assert text.returncode == 0, text.stderr
    assert "bases:" in text.stdout and "gpu.yaml" in text.stdout and "B: gpu" in text.stdout


def test_a_cycle_is_exit_2_naming_it(tmp_path: Path) -> None:
    write(tmp_path / "a.yaml", "_bases_: [sub/b.yaml]\nexperiment_name: e\n")
    write(tmp_path / "sub" / "b.yaml", "_bases_: [../a.yaml]\ncommand: 'true'\n")
    result = air("run", "-f", str(tmp_path / "a.yaml"), "--dry-run")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "_bases_ form a cycle: a.yaml -> sub/b.yaml -> a.yaml" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_file_that_is_its_own_base(tmp_path: Path) -> None:
    path = write(tmp_path / "self.yaml", "_bases_: [./self.yaml]\nexperiment_name: e\n")
    with pytest.raises(UserInputError, match=r"cycle: self.yaml -> self.yaml"):
        load_workload(path)


def test_a_diamond_is_not_a_cycle(tmp_path: Path) -> None:
    write(tmp_path / "root.yaml", "compute: {num_accelerators: 1, accelerator_type: CPU_1xCPU}\ncommand: 'true'\n")
    write(tmp_path / "left.yaml", "_bases_: [root.yaml]\nenv_variables: {L: '1'}\n")
    write(tmp_path / "right.yaml", "_bases_: [root.yaml]\nenv_variables: {R: '1'}\n")
    spec = load_workload(write(tmp_path / "w.yaml", "_bases_: [left.yaml, right.yaml]\nexperiment_name: e\n"))
    assert spec.env_variables == {"L": "1", "R": "1"}


def test_a_missing_base_is_named(tmp_path: Path) -> None:
    path = write(tmp_path / "w.yaml", "experiment_name: e\n_bases_: [nothere.yaml]\n")
    result = air("run", "-f", str(path), "--dry-run")
    assert result.returncode == 2
    assert f"_bases_[0]: base file {tmp_path / 'nothere.yaml'} does not exist" in result.stderr
    assert "(line 2)" in result.stderr


@pytest.mark.parametrize("value", ["base.yaml", "[1]", "['']", "{a: b}"])
def test_bases_must_be_a_list_of_paths(tmp_path: Path, value: str) -> None:
    path = write(tmp_path / "w.yaml", f"_bases_: {value}\nexperiment_name: e\n")
    with pytest.raises(UserInputError, match="_bases_ must be a list of YAML file paths"):
        load_workload(path)


def test_a_problem_in_a_base_names_the_base_and_its_line(tmp_path: Path) -> None:
    write(tmp_path / "b.yaml", "compute:\n  num_accelerators: 1\n  accelerator_type: CPU_1xCPU\n  gpus: 2\n")
    path = write(tmp_path / "w.yaml", "_bases_: [b.yaml]\nexperiment_name: e\ncommand: 'true'\n")
    with pytest.raises(WorkloadSpecError) as info:
        load_workload(path)
    assert "compute.gpus: unknown key: renamed to 'compute.num_accelerators' (line 4 of b.yaml)" in str(info.value)


def test_bases_are_bounded_in_depth(tmp_path: Path) -> None:
    for n in range(MAX_BASES_DEPTH + 2):
        write(tmp_path / f"l{n}.yaml", f"_bases_: [l{n + 1}.yaml]\n")
    write(tmp_path / f"l{MAX_BASES_DEPTH + 2}.yaml", "experiment_name: e\n")
    with pytest.raises(UserInputError, match=f"nest deeper than {MAX_BASES_DEPTH} levels: l0.yaml -> l1.yaml"):
        load_workload(tmp_path / "l0.yaml")


def test_bases_are_bounded_in_count(tmp_path: Path) -> None:
    for n in range(MAX_BASE_FILES + 1):
        write(tmp_path / f"b{n}.yaml", f"env_variables: {{V{n}: '1'}}\n")
    names = ", ".join(f"b{n}.yaml" for n in range(MAX_BASE_FILES + 1))
    path = write(tmp_path / "w.yaml", f"_bases_: [{names}]\nexperiment_name: e\n")
    with pytest.raises(UserInputError, match=f"more than {MAX_BASE_FILES} files in all"):
        load_workload(path)


def test_bases_are_bounded_in_size(tmp_path: Path) -> None:
    big = "parameters:\n" + "".join(f"  k{n}: {'x' * 200}\n" for n in range(3000))  # ~620 KB each
    write(tmp_path / "big1.yaml", big)
    write(tmp_path / "big2.yaml", big)
    path = write(tmp_path / "w.yaml", "_bases_: [big1.yaml, big2.yaml]\nexperiment_name: e\n")
    with pytest.raises(UserInputError, match="the workload and its _bases_ are .* bytes together"):
        load_workload(path)


def test_data_without_its_files_cannot_name_bases() -> None:
    """What reaches a server is the merged spec; one that still names bases is refused, saying why."""
    with pytest.raises(UserInputError, match="_bases_ names files, and this workload came without them"):
        parse_workload({"_bases_": ["base.yaml"], "experiment_name": "e", "command": "true",
                        "compute": {"num_accelerators": 1, "accelerator_type": "CPU_1xCPU"}})
