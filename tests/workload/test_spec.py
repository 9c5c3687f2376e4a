"""The workload spec: valid files load and resolve their paths; every invalid file fails with its field path."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest

from air.errors import UserInputError
from air.workload.loading import WorkloadSpecError, load_workload, parse_workload
from air.workload.spec import RESERVED_ENV_NAMES, WorkloadSpec

HERE = Path(__file__).parent
VALID = HERE / "valid"
INVALID = HERE / "invalid"
INVALID_FILES = sorted(INVALID.glob("*.yaml"))

MINIMAL = """experiment_name: demo
compute:
  num_accelerators: 2
  accelerator_type: CPU_2xCPU
command: echo hi
"""


def expected_phrase(path: Path) -> str:
    first = path.read_text().splitlines()[0]
    match = re.match(r"^# expect: (.+)$", first)
    assert match, f"{path.name} must start with '# expect: <field path or phrase>'"
    return match.group(1).strip()


# ---- valid files ------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted(VALID.glob("*.yaml")), ids=lambda p: p.name)
def test_every_valid_example_loads(path: Path) -> None:
    spec = load_workload(path)
    assert spec.source_path == path.resolve()
    assert spec.source_dir == path.resolve().parent
    stored = spec.to_yaml_dict()  # what the run store keeps reloads to the same spec
    assert WorkloadSpec.model_validate(stored).to_yaml_dict() == stored


def test_full_example_every_field(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # relative paths follow the YAML file, not the working directory
    spec = load_workload(VALID / "full.yaml")
    assert spec.experiment_name == "full-example"
    assert (spec.num_nodes, spec.per_node) == (2, 8)
    assert spec.accelerator.name == "GPU_8xH100" and spec.accelerator.model == "H100"
    assert spec.command.startswith("cd $CODE_SOURCE_PATH\ntorchrun")
    assert spec.environment.version == "4"
    assert spec.environment.dependencies == ["--index-url https://pypi.org/simple", "transformers>=4.45"]
    assert spec.code_source is not None
    assert spec.code_source.snapshot.root_path == str(VALID.resolve() / "code")
    assert spec.code_source.snapshot.include_paths == ["src", "configs"]
    assert spec.max_retries == 0
    assert spec.timeout_minutes == 90 and isinstance(spec.timeout_minutes, int)
    assert spec.env_variables == {
        "NCCL_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "4", "USE_AMP": "true", "LR": "0.0001",
    }
    assert spec.secrets == {"HF_TOKEN": "huggingface/token"}
    assert spec.parameters == {"lr": 0.0001, "model": {"name": "Qwen/Qwen2.5-3B", "layers": [1, 2, 3]}}
    assert spec.run_name == "full_run-1"
    assert spec.idempotency_token == "nightly-2024-06-01"


def test_defaults_of_a_minimal_file() -> None:
    spec = load_workload(VALID / "minimal.yaml")
    assert spec.max_retries == 3
    assert spec.timeout_minutes is None
    assert spec.env_variables == {} and spec.secrets == {}
    assert spec.parameters is None and spec.code_source is None
    assert spec.environment.dependencies is None and spec.environment.version is None
    assert spec.run_name == "minimal"
    assert spec.accelerator.is_cpu and spec.num_nodes == 1
    stored = spec.to_yaml_dict()
    assert stored["mlflow_run_name"] == "minimal" and stored["max_retries"] == 3
    assert "_source_path" not in stored and "source_path" not in stored


def test_dependencies_file_resolves_next_to_the_yaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    spec = load_workload(VALID / "deps_file.yaml")
    assert spec.environment.dependencies == str(VALID.resolve() / "requirements.txt")
    assert spec.code_source is not None and spec.code_source.snapshot.root_path == str(VALID.resolve())
    assert spec.code_source.snapshot.git is not None and spec.code_source.snapshot.git.commit == "3f2c1ab"


def test_root_path_expands_home_and_variables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "home" / "repo").mkdir(parents=True)
    (tmp_path / "data" / "code").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("AIR_TEST_DATA", str(tmp_path / "data"))
    for given, expected in (
        ("~/repo", tmp_path / "home" / "repo"),
        ("$AIR_TEST_DATA/code", tmp_path / "data" / "code"),
        ("${AIR_TEST_DATA}/code", tmp_path / "data" / "code"),
        ("project_root/data", tmp_path / "data"),
    ):
        path = tmp_path / "w.yml"
        path.write_text(MINIMAL + f"code_source:\n  snapshot:\n    root_path: {given}\n")
        spec = load_workload(str(path))
        assert spec.code_source is not None
        assert spec.code_source.snapshot.root_path == str(expected), given


def test_include_path_that_does_not_exist(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    path = tmp_path / "w.yaml"
    path.write_text(MINIMAL + "code_source:\n  snapshot:\n    root_path: .\n    include_paths: [src, srcc]\n")
    with pytest.raises(UserInputError, match=r"code_source\.snapshot\.include_paths\[1\]: 'srcc' does not exist"):
        load_workload(path)


def test_accelerator_counts_and_nodes() -> None:
    base = {"experiment_name": "x", "command": "true"}
    for kind, count, nodes in (("GPU_1xA10", 4, 4), ("GPU_8xH100", 64, 8), ("CPU_2xCPU", 6, 3)):
        spec = parse_workload({**base, "compute": {"num_accelerators": count, "accelerator_type": kind}})
        assert (spec.num_nodes, spec.per_node, spec.compute.accelerator_type) == (nodes, count // nodes, kind)


def test_parse_workload_does_not_change_its_input() -> None:
    compute = {"num_accelerators": 1, "accelerator_type": "CPU_1xCPU"}
    data: dict[str, object] = {"experiment_name": "x", "command": "true", "compute": compute}
    parse_workload(data, overrides=["compute.num_accelerators=2", "parameters.a.b=1"])
    assert compute["num_accelerators"] == 1 and "parameters" not in data


# ---- invalid files ----------------------------------------------------------------------------------


def test_the_invalid_corpus_is_large_enough() -> None:
    assert len(INVALID_FILES) >= 35


@pytest.mark.parametrize("path", INVALID_FILES, ids=lambda p: p.name)
def test_every_invalid_file_names_file_and_field(path: Path) -> None:
    expected = expected_phrase(path)
    with pytest.raises(UserInputError) as info:
        load_workload(path)
    message = str(info.value)
    assert path.name in message, message
    assert expected in message, f"expected {expected!r} in:\n{message}"
    assert info.value.exit_code == 2


def test_every_problem_is_listed_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "train.yaml"
    path.write_text(
        "experiment_name: my exp\n"
        "compute:\n"
        "  num_accelerators: 12\n"
        "  accelerator_type: GPU_8xH100\n"
        "command: echo hi\n"
        "max_retries: -1\n"
        "env_variables:\n"
        "  NODE_RANK: '3'\n"
    )
    with pytest.raises(WorkloadSpecError) as info:
        load_workload(path)
    lines = str(info.value).splitlines()
    assert lines[0].startswith(f"{path}: experiment_name: ") and lines[0].endswith("(line 1)")
    assert lines[1].startswith(f"{path}: compute.num_accelerators: must be a multiple of 8")
    assert lines[1].endswith("(line 3)")
    assert lines[2].startswith(f"{path}: max_retries: ") and lines[2].endswith("(line 6)")
    assert lines[3].startswith(f"{path}: env_variables.NODE_RANK: ") and lines[3].endswith("(line 8)")
    assert [p.loc for p in info.value.problems] == [
        ("experiment_name",), ("compute", "num_accelerators"), ("max_retries",), ("env_variables", "NODE_RANK"),
    ]
    assert info.value.hint and "air -h config." in info.value.hint


def test_renamed_keys_get_a_specific_hint(tmp_path: Path) -> None:
    path = tmp_path / "old.yaml"
    path.write_text(
        "experiment_name: x\nbash_script: echo\nrun_name: r\n"
        "compute: {gpus: 8, gpu_type: GPU_8xH100}\n"
        "environment: {env_variables: {A: '1'}}\n"
        "code_source: {snapshot: {repo_path: .}}\n"
    )
    with pytest.raises(UserInputError) as info:
        load_workload(path)
    message = str(info.value)
    for old, new in (
        ("bash_script", "'command'"),
        ("run_name", "'mlflow_run_name'"),
        ("compute.gpus", "'compute.num_accelerators'"),
        ("compute.gpu_type", "'compute.accelerator_type'"),
        ("environment.env_variables", "top-level 'env_variables'"),
        ("code_source.snapshot.repo_path", "'code_source.snapshot.root_path'"),
    ):
        assert re.search(rf"^{re.escape(str(path))}: {re.escape(old)}: .*{re.escape(new)}", message, re.M), old


@pytest.mark.parametrize("where", ["top", "compute"])
def test_num_nodes_is_refused_with_how_air_counts_nodes(tmp_path: Path, where: str) -> None:
    """There is no num_nodes: the refusal says nodes = num_accelerators / the shape's per-node count."""
    path = tmp_path / "nodes.yaml"
    compute = "{num_accelerators: 16, accelerator_type: GPU_8xH100" + (", num_nodes: 2}" if where == "compute" else "}")
    path.write_text(f"experiment_name: x\n{'num_nodes: 2' if where == 'top' else ''}\ncompute: {compute}\n"
                    "command: echo hi\n")
    with pytest.raises(UserInputError) as info:
        load_workload(path)
    key = "num_nodes" if where == "top" else "compute.num_nodes"
    line = next(line for line in str(info.value).splitlines() if f": {key}: " in line)
    assert "nodes = compute.num_accelerators / the per-node count of compute.accelerator_type" in line, line
    assert "num_accelerators: 16 is 2 nodes" in line


def test_reserved_names_cover_the_node_contract() -> None:
    contract = {"MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "NUM_NODES", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                "CODE_SOURCE_PATH", "MLFLOW_RUN_ID", "HYPERPARAMETERS_PATH"}
    assert contract <= RESERVED_ENV_NAMES


@pytest.mark.parametrize(
    ("name", "content", "phrase"),
    [
        ("train.txt", MINIMAL, "must end in .yaml or .yml"),
        ("missing.yaml", None, "no such file"),
        ("comments.yaml", "# nothing but a comment\n", "the file is empty"),
        ("scalar.yaml", "just a string\n", "top level must be a mapping"),
        ("latin1.yaml", b"experiment_name: caf\xe9\n", "not UTF-8"),
        ("huge.yaml", MINIMAL + "parameters:\n  blob: '" + "x" * (1 << 20) + "'\n", "must be under"),
    ],
)
def test_unreadable_files(tmp_path: Path, name: str, content: str | bytes | None, phrase: str) -> None:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(UserInputError) as info:
        load_workload(path)
    assert name in str(info.value) and phrase in str(info.value)


def test_syntax_error_gives_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("experiment_name: x\ncompute: {num_accelerators: 1\ncommand: echo\n")
    with pytest.raises(UserInputError, match=r"bad\.yaml: invalid YAML at line \d+, column \d+"):
        load_workload(path)


def test_a_folder_is_not_a_workload(tmp_path: Path) -> None:
    folder = tmp_path / "dir.yaml"
    folder.mkdir()
    with pytest.raises(UserInputError, match="is a folder"):
        load_workload(folder)


def test_error_pickles_with_its_problems(tmp_path: Path) -> None:
    path = tmp_path / "train.yaml"
    path.write_text(MINIMAL.replace("demo", "a b"))
    with pytest.raises(WorkloadSpecError) as info:
        load_workload(path)
    clone = pickle.loads(pickle.dumps(info.value))
    assert isinstance(clone, WorkloadSpecError) and isinstance(clone, UserInputError)
    assert str(clone) == str(info.value) and clone.problems == info.value.problems
    assert clone.exit_code == 2
