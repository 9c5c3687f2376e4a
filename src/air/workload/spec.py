"""The workload spec: a strict, typed model of the workload YAML (loading.py reads a file into it).

Validation happens once, at the edge: everything after `load_workload` can trust the spec. The model is
strict (`extra="forbid"` everywhere, no silent "8" → 8), and its validators word every problem the way
loading.py reports it: `FILE: field.path: what is wrong (line N)`. The limits, renamed and unsupported
keys and the shared validators are spec_rules.py.

The same model drives `--override` (overrides.py) and `air -h config` (config_help.py), through the
schema navigation of schema.py, so the three can never disagree about what a field is.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from air.accelerators import AcceleratorType, normalize_model, parse_accelerator_type
from air.bounds import MAX_NUM_ACCELERATORS, MAX_PERMISSION_ENTRIES, MAX_RETRIES, MAX_TIMEOUT_MINUTES
from air.constants import DEFAULT_MAX_RETRIES
from air.errors import GPUTypeError
from air.workload.image_spec import DockerImageSpec
from air.workload.spec_rules import (
    GIT_REF_RE,
    GIT_SHA_RE,
    MAX_COMMAND_LINES,
    MAX_IDEMPOTENCY_TOKEN,
    RESERVED_ENV_NAMES,
    EnvName,
    EnvValue,
    PermissionEntry,
    SecretRef,
    check_name,
    fail,
    show_value,
)
from air.workload.sweep_spec import ForEachSpec


class _Section(BaseModel):
    """Base of every section: unknown keys are errors, and no silent type coercion ("8" is not 8)."""

    model_config = ConfigDict(extra="forbid", strict=True)


# ---- sections ---------------------------------------------------------------------------------------


class ComputeSpec(_Section):
    """What the command runs on: how many accelerators, of which node shape."""

    num_accelerators: int = Field(
        gt=0,
        le=MAX_NUM_ACCELERATORS,
        description="Total accelerators across all nodes: GPUs, or CPU processes for a CPU type. A positive "
        "multiple of the type's devices per node; nodes = num_accelerators / per node (GPU_8xH100 takes "
        "8, 16, 24, …; 16 is 2 nodes). The backend refuses a count it can never hold.",
        examples=[8],
    )
    accelerator_type: str = Field(
        description="Node shape <KIND>_<per node>x<MODEL>, case-sensitive: GPU_1xA10, GPU_1xH100, GPU_8xH100, "
        "… or CPU_<n>xCPU to run without a GPU (n processes per node, gloo instead of NCCL), e.g. for a "
        "laptop or CI.",
        examples=["GPU_8xH100", "CPU_2xCPU"],
    )
    pool: str | None = Field(
        default=None,
        description="The pool to wait in and run on (`air get pools` lists them; pools are set in the config.yaml "
        "of the AIR_HOME runs go to: the server's, through `air server`). Unset: DATABRICKS_USE_RESERVED_GPU_POOL "
        "(1/True: `reserved`; 0/False: `on-demand` where configured), else the default pool.",
        examples=["reserved"],
    )
    priority_class: Literal["BEST_EFFORT", "NORMAL", "CRITICAL"] = Field(
        default="NORMAL",
        description="Where the run stands in its pool's queue (any case): CRITICAL first, then NORMAL, then "
        "BEST_EFFORT; first in first out within a class. A CRITICAL run that finds its pool full preempts "
        "BEST_EFFORT runs (newest first, as few as needed): their attempt ends PREEMPTED, they go back to the "
        "queue and resume from AIR_CHECKPOINT_DIR, not counted against max_retries. On `air server`, only the "
        "users it names (--critical-users) may submit CRITICAL.",
        examples=["BEST_EFFORT"],
    )

    @field_validator("priority_class", mode="before")
    @classmethod
    def _upper_priority(cls, value: object) -> object:
        if not isinstance(value, str) or value.upper() not in ("BEST_EFFORT", "NORMAL", "CRITICAL"):
            fail(f"must be BEST_EFFORT, NORMAL or CRITICAL, got {show_value(value)}")
        return value.upper()

    @field_validator("accelerator_type", mode="before")
    @classmethod
    def _parse_type(cls, value: object) -> str:
        if not isinstance(value, str):
            fail(f"must be a type name like GPU_8xH100 or CPU_2xCPU, got {show_value(value)}")
        try:
            return parse_accelerator_type(value).name
        except GPUTypeError as exc:
            guess = _guess_accelerator_type(value)
            did_you_mean = f"; did you mean {guess!r}?" if guess else "."
            fail(f"unknown accelerator type {value!r}{did_you_mean} {exc.hint or ''}".strip())

    @model_validator(mode="after")
    def _whole_nodes(self) -> ComputeSpec:
        per_node = self.accelerator.per_node
        if self.num_accelerators % per_node:
            multiples = ", ".join(str(per_node * k) for k in (1, 2, 3))
            fail(
                f"must be a multiple of {per_node}, the devices per node of {self.accelerator_type} "
                f"(use {multiples}, …), got {self.num_accelerators}",
                field="num_accelerators",
            )
        return self

    @property
    def accelerator(self) -> AcceleratorType:
        return parse_accelerator_type(self.accelerator_type)

    @property
    def per_node(self) -> int:
        return self.accelerator.per_node

    @property
    def num_nodes(self) -> int:
        return self.num_accelerators // self.accelerator.per_node


def _guess_accelerator_type(value: str) -> str | None:
    """The canonical spelling of a near miss: `gpu_8xh100` → GPU_8xH100, legacy `a10` → GPU_1xA10."""
    legacy = {"a10": "GPU_1xA10", "a10g": "GPU_1xA10", "h100_80gb": "GPU_8xH100"}
    if value.strip().lower() in legacy:
        return legacy[value.strip().lower()]
    match = re.match(r"(?i)^\s*(gpu|cpu)[_-]?([1-9][0-9]*)\s*x\s*([A-Za-z0-9]+)\s*$", value)
    if not match:
        return None
    kind, count, model = match.group(1).upper(), match.group(2), match.group(3)
    model = "CPU" if kind == "CPU" else (normalize_model(model) or model.upper())
    guess = f"{kind}_{count}x{model}"
    return guess if guess != value.strip() else None


class EnvironmentSpec(_Section):
    """The Python environment the command runs in: a base environment plus extra packages."""

    version: int | str | None = Field(
        None,
        description="Base environment to layer the dependencies on: a name or number defined in your air "
        "configuration ($AIR_HOME/config.yaml). Unset: the configured default.",
        examples=["4"],
    )
    dependencies: list[str] | str | None = Field(
        None,
        description="Extra packages, installed with uv into a virtual environment on top of the base "
        "environment and cached by content (the next run with the same list starts at once). Either a list "
        "of pip requirement lines ('torch==2.4.0', '--index-url URL', a wheel path) or the path of a "
        "requirements file, relative to the YAML file's folder.",
        examples=[["transformers>=4.45", "datasets>=3.0"], "requirements.txt"],
        json_schema_extra={"air_type": "list of strings, or the path of a requirements file"},
    )
    docker_image: DockerImageSpec | None = Field(
        None, description="A container image every node runs in (its own python3 and libraries); exclusive "
        "with 'dependencies' and 'version'. See docs/containers.md.",
        examples=[{"url": "127.0.0.1:5000/team/train:v1", "tag_policy": "auto"}])

    @model_validator(mode="after")
    def _image_alone(self) -> EnvironmentSpec:
        if self.docker_image is not None:
            for name in ("dependencies", "version"):
                if getattr(self, name) is not None:
                    fail(f"cannot be combined with environment.{name}: the image is the environment "
                         "(install packages in the image)", field="docker_image")
        return self

    @field_validator("version", mode="before")
    @classmethod
    def _version(cls, value: object) -> object:
        if value is None or (isinstance(value, int) and not isinstance(value, bool)):
            return value
        if isinstance(value, str) and value.strip():
            return value.strip()
        fail(f"must be a base environment name or number, got {show_value(value)}")

    @field_validator("dependencies", mode="before")
    @classmethod
    def _dependencies(cls, value: object) -> object:
        if value is None:
            return None
        if isinstance(value, str):
            if not value.strip():
                fail("must be a list of requirements or the path of a requirements file, got ''")
            return value
        if isinstance(value, list):
            for index, item in enumerate(value):
                if not isinstance(item, str) or not item.strip():
                    fail(
                        f"item {index} must be a requirement string like 'torch==2.4.0', got {show_value(item)}"
                    )
            return [item.strip() for item in value]
        fail(f"must be a list of requirements or the path of a requirements file, got {show_value(value)}")


class GitSpec(_Section):
    """Pin the snapshot to a committed state: exactly one of `branch` or `commit`."""

    branch: str | None = Field(
        None,
        description="Ship the tip of this local branch. Refused while the working tree has uncommitted "
        "changes, so what runs is what is committed (pin a commit to be exact).",
        examples=["main"],
    )
    commit: str | None = Field(
        None,
        description="Ship this commit's tree (a full or abbreviated SHA), whatever the working tree holds.",
        examples=["3f2c1ab"],
    )

    @field_validator("branch")
    @classmethod
    def _branch(cls, value: str | None) -> str | None:
        if value is not None and (not GIT_REF_RE.match(value) or value.startswith("-")):
            fail(f"is not a valid branch name (letters, digits, '_', '.', '/', '-'), got {show_value(value)}")
        return value

    @field_validator("commit", mode="before")
    @classmethod
    def _commit(cls, value: object) -> object:
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)  # an all-digit abbreviated SHA reads as an integer in YAML
        if value is not None and isinstance(value, str) and not GIT_SHA_RE.match(value):
            fail(f"must be a commit SHA (4 to 64 hex digits), got {show_value(value)}")
        return value

    @model_validator(mode="after")
    def _exactly_one(self) -> GitSpec:
        if (self.branch is None) == (self.commit is None):
            both = "not both" if self.branch is not None else "got neither"
            fail(f"set exactly one of 'branch' or 'commit' ({both})")
        return self


class SnapshotSpec(_Section):
    """A copy of a folder (or of a commit of it) that every node gets as CODE_SOURCE_PATH."""

    root_path: str = Field(
        description="Folder to ship. Relative paths resolve against the YAML file's folder; '~' and $VAR are "
        "expanded. The files shipped are those git would see: tracked plus untracked-but-not-ignored "
        "(.gitignore honoured also outside a repository).",
        examples=["."],
    )
    include_paths: list[str] | None = Field(
        None,
        description="Ship only these files or folders, relative to root_path (no '..'); not an empty list. "
        "Default: all of root_path.",
        examples=[["src", "configs"]],
    )
    git: GitSpec | None = Field(
        None,
        description="Pin the snapshot to a branch or a commit instead of the working tree; root_path must be "
        "in a git repository.",
        examples=[{"commit": "3f2c1ab"}],
    )

    @field_validator("root_path")
    @classmethod
    def _root_path(cls, value: str) -> str:
        if not value.strip():
            fail("must name a folder, got ''")
        return value

    @field_validator("include_paths")
    @classmethod
    def _include_paths(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return None
        if not value:
            fail("must not be an empty list (remove the key to ship all of root_path)")
        out: list[str] = []
        for raw in value:
            text = raw.strip().replace("\\", "/")
            if not text or text.startswith(("/", "~")) or os.path.isabs(text):
                fail(f"must hold paths relative to root_path, got {show_value(raw)}")
            parts = [p for p in text.split("/") if p not in ("", ".")]
            if ".." in parts:
                fail(f"must not leave root_path ('..'), got {show_value(raw)}")
            out.append("/".join(parts) or ".")
        return out


class CodeSourceSpec(_Section):
    """Code that ships with the run (CODE_SOURCE_PATH on every node)."""

    type: Literal["snapshot"] = Field(
        "snapshot", description="Kind of code source; 'snapshot' is the only one.", examples=["snapshot"]
    )
    snapshot: SnapshotSpec = Field(
        description="The folder to copy into the run. Content-addressed: an unchanged tree is not copied twice.",
        examples=[{"root_path": "."}],
    )


class SlurmSpec(_Section):
    """`slurm:` options of this run's Slurm jobs (a `slurm` profile; docs/slurm.md): sbatch's long option
    names with `_` for `-`. They win over the profile's; the nodes, tasks and GPUs come from `compute`."""

    partition: str | None = Field(None, description="sbatch --partition: the partition the jobs wait in.",
                                  examples=["debug"])
    account: str | None = Field(None, description="sbatch --account: the account charged.", examples=["ml-lab"])
    qos: str | None = Field(None, description="sbatch --qos: the quality of service.", examples=["high"])
    constraint: str | None = Field(None, description="sbatch --constraint: node features required.",
                                   examples=["a100&ib"])
    reservation: str | None = Field(None, description="sbatch --reservation: run inside this reservation.")
    time: str | int | None = Field(
        None, description="sbatch --time: each attempt's Slurm time limit, minutes or MM:SS, HH:MM:SS, "
        "D-HH:MM; past it Slurm ends the job and the attempt is TIMEDOUT.", examples=["2:00:00", 90])
    mem: str | None = Field(None, description="sbatch --mem: memory per node (e.g. 64G); past it Slurm's OOM "
                            "kill ends the attempt (failure class OOM).", examples=["64G"])
    cpus_per_task: int | None = Field(None, gt=0, description="sbatch --cpus-per-task: CPUs of each node's task "
                                      "(default: the node shape's processes for a CPU shape).", examples=[16])
    exclude: str | None = Field(None, description="sbatch --exclude: nodes never to use.", examples=["gpu[07-08]"])
    nodelist: str | None = Field(None, description="sbatch --nodelist: nodes to use.", examples=["gpu[01-02]"])
    comment: str | None = Field(None, description="sbatch --comment: a note shown by squeue/sacct.")

    @field_validator("time", mode="before")
    @classmethod
    def _time(cls, value: object) -> object:
        if value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            return value
        if isinstance(value, str) and re.fullmatch(r"(\d+-)?\d+(:\d+){0,2}|UNLIMITED|INFINITE", value.strip()):
            return value.strip()
        fail(f"must be minutes or Slurm's [D-]HH:MM:SS (sbatch --time), got {show_value(value)}")


class PermissionSpec(_Section):
    """One entry of `permissions`: who (a user, or a group of the server's config) may do what with the run."""

    user_name: str | None = Field(None, description="An air user (the name of their `air server` token).",
                                  examples=["bob"])
    group_name: str | None = Field(None, description="A group under `groups:` in the server's config.yaml.",
                                   examples=["ml-team"])
    level: Literal["CAN_VIEW", "CAN_MANAGE_RUN", "CAN_MANAGE"] = Field(
        description="CAN_VIEW: see the run, its logs and MLflow runs; CAN_MANAGE_RUN: also cancel it; "
        "CAN_MANAGE: also change its permissions.", examples=["CAN_VIEW"])


# ---- the workload -----------------------------------------------------------------------------------


class WorkloadSpec(_Section):
    """A workload YAML, validated. Build it with `load_workload`; `model_validate` skips path resolution."""

    experiment_name: str = Field(
        description="Name of the MLflow experiment the run logs to (created if missing, else appended to); also "
        "how `air list runs` shows the run. Letters, digits, '_' and '-', at most 100 characters.",
        examples=["llm-finetune"],
    )
    compute: ComputeSpec = Field(
        description="What the command runs on: total accelerators and the node shape. The command runs once per "
        "node; nodes = num_accelerators / devices per node.",
        examples=[{"num_accelerators": 8, "accelerator_type": "GPU_8xH100"}],
    )
    command: str = Field(
        description="Bash script run once per node (not once per accelerator) under `set -euo pipefail`; start "
        "one process per accelerator yourself (torchrun, accelerate, ray). It sees CODE_SOURCE_PATH, "
        "MASTER_ADDR, MASTER_PORT, NUM_NODES, NODE_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MLFLOW_RUN_ID, "
        "MLFLOW_TRACKING_URI, HYPERPARAMETERS_PATH (with parameters) and your env_variables and secrets. "
        "At most 1000 lines.",
        examples=[
            "cd $CODE_SOURCE_PATH\ntorchrun --nnodes=$NUM_NODES --node_rank=$NODE_RANK \\\n"
            "  --master_addr=$MASTER_ADDR --master_port=$MASTER_PORT \\\n"
            "  --nproc_per_node=$LOCAL_WORLD_SIZE train.py\n"
        ],
    )
    environment: EnvironmentSpec = Field(
        default_factory=EnvironmentSpec,
        description="Python environment of the command: a base environment plus extra packages (a uv virtual "
        "environment, cached by content).",
        examples=[{"dependencies": ["transformers>=4.45"]}],
    )
    code_source: CodeSourceSpec | None = Field(
        None,
        description="Code shipped with the run: a snapshot of a folder, seen by every node at CODE_SOURCE_PATH.",
        examples=[{"type": "snapshot", "snapshot": {"root_path": "."}}],
    )
    max_retries: int = Field(
        DEFAULT_MAX_RETRIES,
        ge=0,
        le=MAX_RETRIES,
        description="Retries after a failed or timed-out attempt; each attempt starts fresh, with its own logs "
        "and MLflow run. 3 means up to 4 attempts; 0 turns retries off.",
        examples=[1],
    )
    timeout_minutes: int | float | None = Field(
        None,
        description="Wall-clock limit of each attempt, in minutes; an attempt past it is ended (TIMEDOUT) and "
        "retried while retries remain, so 90 minutes with max_retries: 2 can take up to 270. Unset: no limit.",
        examples=[90],
    )
    hang_timeout_minutes: int | float | None = Field(
        None,
        description="Minutes any node may go without progress (a line of output, air.runtime.heartbeat(), a "
        "ray.train.report) before the attempt counts as hung: air saves every process's Python stacks in the "
        "attempt's folder, ends it (failure class HANG, reason 'Hang: node N made no progress for ...') and "
        "retries it while retries remain. Unset: off.",
        examples=[15],
    )
    env_variables: dict[EnvName, EnvValue] = Field(
        default_factory=dict,
        description="Environment variables of the command on every node, NAME: value. Numbers and booleans "
        "become strings (quote a value to keep it literal: 'yes', '010'). A name may not also be in secrets, "
        "nor be one air sets itself (MASTER_ADDR, NODE_RANK, WORLD_SIZE, CUDA_VISIBLE_DEVICES, …).",
        examples=[{"NCCL_SOCKET_IFNAME": "eth0", "TOKENIZERS_PARALLELISM": "false"}],
        json_schema_extra={"air_type": "map: NAME → string"},
    )
    secrets: dict[EnvName, SecretRef] = Field(
        default_factory=dict,
        description="Environment variables whose values come from the local secret store, NAME: scope/key. "
        "The values are read when the run starts and never printed by dry-run, get, list or logs.",
        examples=[{"HF_TOKEN": "huggingface/token"}],
        json_schema_extra={"air_type": "map: NAME → scope/key"},
    )
    parameters: dict[str, Any] | None = Field(
        None,
        description="Hyperparameters, any nesting. Written to a YAML file on every node; its path is in "
        "HYPERPARAMETERS_PATH.",
        examples=[{"lr": 0.0001, "epochs": 3, "model": {"name": "Qwen/Qwen2.5-3B"}}],
    )
    mlflow_run_name: str | None = Field(
        None,
        description="Name of each attempt's MLflow run; default: experiment_name. Letters, digits, '_' and "
        "'-', at most 100 characters.",
        examples=["lr-1e-4"],
    )
    for_each: ForEachSpec | None = Field(
        None,
        description="A sweep: one child run per item, each an ordinary run (logs, retries, MLflow run nested "
        "under the sweep's) with its item merged over `parameters` in HYPERPARAMETERS_PATH and its index in "
        "AIR_SWEEP_INDEX. `parameters:` is a grid (every combination), `items:` a list of maps; "
        "`max_concurrent` bounds how many children are active at once. The sweep is SUCCESS only if every "
        "child is; canceling it cancels its children.",
        examples=[{"parameters": {"lr": [0.001, 0.0001], "batch_size": [16, 32]}, "max_concurrent": 2}],
    )
    idempotency_token: str | None = Field(
        None,
        description="Submitting again with a token already used returns the existing run instead of starting "
        "a new one. At most 64 characters; `air run --idempotency-key` wins over it.",
        examples=["nightly-2024-06-01"],
    )
    permissions: list[Annotated[PermissionSpec, PermissionEntry]] | None = Field(
        None, max_length=MAX_PERMISSION_ENTRIES,
        description="Who else may see or act on the run on an `air server`: entries of user_name or group_name "
        "(a group under `groups:` in the server's config.yaml) and level CAN_VIEW, CAN_MANAGE_RUN (also cancel) "
        "or CAN_MANAGE (also change permissions). The owner and admins keep everything; under the server's "
        "`default_visibility: private` no one else sees the run. Locally (no server) it is kept, with no effect.",
        examples=[[{"user_name": "bob", "level": "CAN_VIEW"}, {"group_name": "ml-team", "level": "CAN_MANAGE_RUN"}]],
        json_schema_extra={"air_type": "list of {user_name | group_name, level}"},
    )

    slurm: SlurmSpec | None = Field(
        None,
        description="Options of this run's Slurm jobs under a `slurm` profile (sbatch's names, `_` for `-`: "
        "partition, account, qos, constraint, reservation, time, mem, cpus_per_task, exclude, nodelist, "
        "comment); they win over the profile's. Ignored by other backends.",
        examples=[{"partition": "gpu", "time": "2:00:00", "mem": "64G"}],
    )

    _source_path: Path | None = PrivateAttr(default=None)
    _source_dir: Path | None = PrivateAttr(default=None)
    _bases: tuple[Path, ...] = PrivateAttr(default=())

    @field_validator("experiment_name")
    @classmethod
    def _experiment_name(cls, value: str) -> str:
        return check_name(value, "experiment_name")

    @field_validator("mlflow_run_name")
    @classmethod
    def _run_name(cls, value: str | None) -> str | None:
        return None if value is None else check_name(value, "mlflow_run_name")

    @field_validator("command")
    @classmethod
    def _command(cls, value: str) -> str:
        if not value.strip():
            fail("must not be empty: it is the bash script each node runs")
        lines = len(value.splitlines())
        if lines > MAX_COMMAND_LINES:
            fail(
                f"has {lines} lines, more than {MAX_COMMAND_LINES}; put the script in your code_source and run "
                "it from there (bash $CODE_SOURCE_PATH/run.sh)"
            )
        return value

    @field_validator("environment", "env_variables", "secrets", mode="before")
    @classmethod
    def _empty_block(cls, value: object) -> object:
        """`environment:` with nothing under it means the defaults, not an error."""
        return {} if value is None else value

    @field_validator("timeout_minutes", "hang_timeout_minutes", mode="before")
    @classmethod
    def _timeout(cls, value: object) -> object:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            fail(f"must be a number of minutes, got {show_value(value)}")
        if not math.isfinite(value) or value <= 0:
            fail(f"must be greater than 0 (remove it for no limit), got {show_value(value)}")
        if value > MAX_TIMEOUT_MINUTES:
            fail(f"must be at most {MAX_TIMEOUT_MINUTES} minutes (30 days; remove it for no limit), "
                  f"got {show_value(value)}")
        return value

    @field_validator("idempotency_token", mode="before")
    @classmethod
    def _token(cls, value: object) -> object:
        if value is None:
            return None
        if not isinstance(value, str):
            fail(f"must be a string, got {show_value(value)}")
        token = value.strip()
        if not token:
            fail("must not be empty")
        if len(token) > MAX_IDEMPOTENCY_TOKEN:
            fail(f"is {len(token)} characters long; at most {MAX_IDEMPOTENCY_TOKEN}")
        return token

    @field_validator("secrets")
    @classmethod
    def _no_shared_names(cls, value: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        plain = info.data.get("env_variables") or {}
        both = sorted(set(plain) & set(value))
        if both:
            fail(
                f"{', '.join(both)} {'is' if len(both) == 1 else 'are'} also in env_variables; "
                "a name is either a plain variable or a secret",
                field=both[0],
            )
        return value

    # ---- derived values ----

    @property
    def accelerator(self) -> AcceleratorType:
        """The node shape (GPU_8xH100 → kind GPU, 8 per node, model H100)."""
        return self.compute.accelerator

    @property
    def per_node(self) -> int:
        return self.compute.per_node

    @property
    def num_nodes(self) -> int:
        return self.compute.num_nodes

    @property
    def run_name(self) -> str:
        """The MLflow run name: mlflow_run_name, else experiment_name."""
        return self.mlflow_run_name or self.experiment_name

    @property
    def source_path(self) -> Path | None:
        """The YAML file this spec was read from (absolute), or None when built from a dict."""
        return self._source_path

    @property
    def bases(self) -> tuple[Path, ...]:
        """The `_bases_` files merged into this spec, in merge order (empty when there were none)."""
        return self._bases

    @property
    def source_dir(self) -> Path | None:
        """The folder relative paths were resolved against."""
        return self._source_dir

    def to_yaml_dict(self) -> dict[str, Any]:
        """The resolved spec (absolute paths, defaults filled in) as plain data, for the run store.

        Loading it again with `WorkloadSpec.model_validate` gives an equal spec.
        """
        data = self.model_dump(mode="python", exclude_none=True)
        data["mlflow_run_name"] = self.run_name
        return data


__all__ = [
    "CodeSourceSpec",
    "ComputeSpec",
    "EnvironmentSpec",
    "GitSpec",
    "PermissionSpec",
    "SlurmSpec",
    "RESERVED_ENV_NAMES",
    "SnapshotSpec",
    "WorkloadSpec",
]
