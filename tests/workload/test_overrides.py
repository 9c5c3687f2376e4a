"""`--override key.path=value`: coerced to the field's type, wins over the YAML, unknown keys refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from air.errors import UserInputError
from air.workload.loading import WorkloadSpecError, load_workload
from air.workload.overrides import coerce_value, parse_override
from air.workload.spec import WorkloadSpec

MINIMAL = Path(__file__).parent / "valid" / "minimal.yaml"
FULL = Path(__file__).parent / "valid" / "full.yaml"


def test_ints_and_numbers_are_coerced() -> None:
    spec = load_workload(MINIMAL, ["compute.num_accelerators=4", "compute.accelerator_type=CPU_2xCPU",
                                   "max_retries=0", "timeout_minutes=1.5"])
    assert spec.compute.num_accelerators == 4 and spec.num_nodes == 2
    assert spec.max_retries == 0
    assert spec.timeout_minutes == 1.5


def test_overrides_win_over_the_file_and_later_ones_win() -> None:
    spec = load_workload(FULL, ["compute.num_accelerators=8", "compute.num_accelerators=24", "max_retries=5"])
    assert spec.compute.num_accelerators == 24 and spec.num_nodes == 3
    assert spec.max_retries == 5
    assert spec.environment.dependencies == ["--index-url https://pypi.org/simple", "transformers>=4.45"]


def test_string_fields_keep_the_text_as_typed() -> None:
    spec = load_workload(MINIMAL, ["experiment_name=123", "command=echo a # not a comment",
                                   "mlflow_run_name='007'", "environment.version=4"])
    assert spec.experiment_name == "123"
    assert spec.command == "echo a # not a comment"
    assert spec.run_name == "007"
    assert spec.environment.version == 4  # int or str: the YAML reading is kept


def test_maps_create_missing_keys_at_any_depth() -> None:
    spec = load_workload(FULL, ["parameters.model.name=gpt2", "parameters.optim.betas=[0.9, 0.95]",
                                "parameters.amp=true", "parameters.deep.a.b.c=1",
                                "env_variables.NEW_VAR=1", "env_variables.FLAG=true",
                                "secrets.WANDB_API_KEY=wandb/key"])
    assert spec.parameters is not None
    assert spec.parameters["model"] == {"name": "gpt2", "layers": [1, 2, 3]}
    assert spec.parameters["optim"] == {"betas": [0.9, 0.95]}
    assert spec.parameters["amp"] is True
    assert spec.parameters["deep"] == {"a": {"b": {"c": 1}}}
    assert spec.env_variables["NEW_VAR"] == "1" and spec.env_variables["FLAG"] == "true"
    assert spec.env_variables["NCCL_SOCKET_IFNAME"] == "eth0"  # untouched keys stay
    assert spec.secrets["WANDB_API_KEY"] == "wandb/key"


def test_missing_sections_are_created(tmp_path: Path) -> None:
    (tmp_path / "code").mkdir()
    yaml_file = tmp_path / "w.yaml"
    yaml_file.write_text(MINIMAL.read_text())
    spec = load_workload(yaml_file, ["code_source.snapshot.root_path=code",
                                     "code_source.snapshot.git.branch=main",
                                     "environment.dependencies=[torch, numpy]"])
    assert spec.code_source is not None
    assert spec.code_source.snapshot.root_path == str(tmp_path / "code")  # relative to the YAML, as in it
    assert spec.code_source.snapshot.git is not None and spec.code_source.snapshot.git.branch == "main"
    assert spec.environment.dependencies == ["torch", "numpy"]


def test_null_clears_an_optional_field() -> None:
    spec = load_workload(FULL, ["timeout_minutes=null", "mlflow_run_name=null"])
    assert spec.timeout_minutes is None and spec.run_name == "full-example"


def test_unknown_key_is_an_error_with_did_you_mean() -> None:
    with pytest.raises(UserInputError) as info:
        load_workload(MINIMAL, ["compute.num_acelerators=8"])
    message = str(info.value)
    assert "minimal.yaml: compute.num_acelerators: unknown key; did you mean 'num_accelerators'?" in message
    assert "(from --override compute.num_acelerators=8)" in message


def test_renamed_key_in_an_override() -> None:
    with pytest.raises(UserInputError, match=r"compute\.gpus: unknown key: renamed to 'compute\.num_accel"):
        load_workload(MINIMAL, ["compute.gpus=8"])


def test_wrong_value_blames_the_override() -> None:
    with pytest.raises(WorkloadSpecError) as info:
        load_workload(MINIMAL, ["max_retries=many", "compute.num_accelerators=3",
                                "compute.accelerator_type=CPU_2xCPU"])
    message = str(info.value)
    assert "minimal.yaml: max_retries: must be an integer, got 'many' (from --override max_retries=many)" in message
    assert "compute.num_accelerators: must be a multiple of 2" in message


@pytest.mark.parametrize(
    ("override", "phrase"),
    [
        ("max_retries", "expected KEY=VALUE"),
        ("=3", "expected KEY=VALUE"),
        ("compute..num_accelerators=3", "expected KEY=VALUE"),
        ("command.x=1", "command: is a string and has no keys"),
        ("env_variables.A.B=1", "env_variables.A: is a string and has no keys"),
        ("environment.dependencies.0=torch", "environment.dependencies: is a list"),
        ("parameters.lr.warmup=5", "parameters.lr: is 0.0001 (a number) in the YAML, not a mapping"),
        ("env_variables.1X=1", "env_variables.1X"),
        ("secrets.TOKEN=nope", "secrets.TOKEN: must be a secret reference"),
    ],
)
def test_bad_overrides(override: str, phrase: str) -> None:
    with pytest.raises(UserInputError) as info:
        load_workload(FULL, [override])
    assert "full.yaml" in str(info.value) and phrase in str(info.value), str(info.value)


def test_parse_override_splits_on_the_first_equals() -> None:
    assert parse_override("parameters.expr=a=b") == (("parameters", "expr"), "a=b")
    assert parse_override("experiment_name=") == (("experiment_name",), "")


@pytest.mark.parametrize(
    ("field", "raw", "value"),
    [
        ("max_retries", "7", 7),
        ("max_retries", "seven", "seven"),  # left for the model to refuse
        ("timeout_minutes", "2", 2),
        ("timeout_minutes", "2.5", 2.5),
        ("experiment_name", "true", "true"),
        ("experiment_name", '"quoted"', "quoted"),
        ("parameters", "{a: 1}", {"a": 1}),
        ("idempotency_token", "null", None),
    ],
)
def test_coerce_value(field: str, raw: str, value: object) -> None:
    coerced = coerce_value(raw, WorkloadSpec.model_fields[field].annotation)
    assert coerced == value and type(coerced) is type(value)
