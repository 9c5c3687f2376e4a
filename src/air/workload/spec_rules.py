"""The workload spec's rules: name and size limits, keys renamed or not supported, and the small validators
the spec's models (spec.py) share, worded the way loading.py reports problems.

Also what the readers of a spec's errors need without the models: `dotted` field paths, `show_value`, and
`Problem` (one thing wrong, which loading.py and overrides.py both report).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, NoReturn

from pydantic import AfterValidator, BeforeValidator
from pydantic_core import PydanticCustomError

from air.settings import AIR_PROCESS_TAG

#: experiment_name and mlflow_run_name: they become MLflow names and folder names, so no spaces or dots.
NAME_RE = re.compile(r"^[A-Za-z0-9_-]+$")
MAX_NAME_LENGTH = 100
MAX_COMMAND_LINES = 1000
MAX_IDEMPOTENCY_TOKEN = 64
#: A workload YAML larger than this is almost certainly data that belongs in the code snapshot.
MAX_YAML_BYTES = 1 << 20
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: Git refs: also guards against option injection (`--upload-pack=…`); same rule as snapshot.py.
GIT_REF_RE = re.compile(r"^[\w./-]+$")
GIT_SHA_RE = re.compile(r"^[0-9a-fA-F]{4,64}$")
#: Secret scope and key names (the secret store's charset; '/' separates them).
SECRET_PART_RE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")

#: Variables air sets on every node (SPEC "Contract with the user's code"); a workload may not change them,
#: or torchrun would rendezvous at the wrong place. CUDA_VISIBLE_DEVICES is each node's slice of the GPUs
#: (a user value would make concurrent runs share GPUs); the process tag is how teardown finds processes.
RESERVED_ENV_NAMES: frozenset[str] = frozenset(
    {
        "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "NUM_NODES", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
        "CODE_SOURCE_PATH", "MLFLOW_RUN_ID", "HYPERPARAMETERS_PATH", "CUDA_VISIBLE_DEVICES", AIR_PROCESS_TAG,
    }
)

#: Keys of the hosted product (or older air versions) that now live elsewhere: full dotted path → hint.
RENAMED_KEYS: dict[str, str] = {
    "bash_script": "renamed to 'command'",
    "run_name": "renamed to 'mlflow_run_name'",
    "compute.gpus": "renamed to 'compute.num_accelerators'",
    # The hosted product's ways to name capacity; here pools are named under `pools:` in config.yaml.
    **{f"compute.{hosted}": "renamed to 'compute.pool' (a pool under `pools:` in config.yaml; `air get pools` "
       "lists them)" for hosted in ("pool_id", "node_pool_id", "pool_name")},
    "compute.gpu_type": "renamed to 'compute.accelerator_type' (e.g. GPU_8xH100)",
    "compute.num_gpus": "use 'compute.num_accelerators'",
    "compute.gpu": "use 'compute.num_accelerators' (how many) and 'compute.accelerator_type' (which)",
    "code_source.snapshot.repo_path": "renamed to 'code_source.snapshot.root_path'",
    "code_source.root_path": "put it under 'code_source.snapshot.root_path' (with 'code_source.type: snapshot')",
    "code_source.include_paths": "put it under 'code_source.snapshot.include_paths'",
    "code_source.git": "put it under 'code_source.snapshot.git'",
    "environment.env_variables": "moved to the top-level 'env_variables'",
    "environment.env_variables_secrets": "moved to the top-level 'secrets'",
    "env_variables_secrets": "renamed to 'secrets'",
    "workspace": "there are no workspaces; choose the backend with `air -p PROFILE` (or AIR_PROFILE)",
    # Not a field anywhere: the node count follows from the two that are.
    **{key: "air derives it: nodes = compute.num_accelerators / the per-node count of compute.accelerator_type "
       "(GPU_8xH100: 8 per node, so num_accelerators: 16 is 2 nodes; CPU_1xCPU: 1 per node)"
       for key in ("num_nodes", "compute.num_nodes", "nodes", "compute.nodes")},
}

_UNSUPPORTED = "a hosted-product field that air does not support"
#: Fields of the hosted product with no meaning on one's own machines: full dotted path → hint.
HOSTED_ONLY_KEYS: dict[str, str] = {
    "experiment_directory": f"{_UNSUPPORTED}; experiments live in the MLflow tracking store (MLFLOW_TRACKING_URI)",
    "mlflow_experiment_directory": f"{_UNSUPPORTED}; experiments live in the MLflow tracking store "
    "(MLFLOW_TRACKING_URI)",
    "mlflow_artifact_location": f"{_UNSUPPORTED}; artifacts go where the MLflow tracking store puts them",
    **{k: f"{_UNSUPPORTED}; there is no billing policy here: limits are the pools and the per-user limit of "
       "config.yaml (`air get pools`)" for k in ("usage_policy_name", "usage_policy_id")},
    "priority": f"{_UNSUPPORTED}; use compute.priority_class (BEST_EFFORT, NORMAL or CRITICAL)",
    "job_type": f"{_UNSUPPORTED}; every workload runs its 'command'",
    "udp": f"{_UNSUPPORTED}; run batch inference from 'command'",
    "_bases_": "names base files, which only `air run -f FILE` can read: it merges them before submitting",
    "compute.provisioned_capacity_id": f"{_UNSUPPORTED}; the backend (-p PROFILE) decides where runs go",
    **{f"environment.{k}": f"{_UNSUPPORTED}; runs use no container image: list packages in "
       "'environment.dependencies' (a cached uv environment)" for k in ("custom_image_tag", "unity_catalog_image")},
    "code_source.snapshot.remote_volume": f"{_UNSUPPORTED}; snapshots are stored under AIR_HOME",
    "code_source.snapshot.git.remote": f"{_UNSUPPORTED}; pin a local branch or a commit",
}


# ---- small helpers ----------------------------------------------------------------------------------


def fail(message: str, field: str | None = None) -> NoReturn:
    """Raise a validation error with our own wording; `field` moves it one level down (cross-field checks)."""
    raise PydanticCustomError("air_invalid", message, {"air_field": field} if field else None)


def show_value(value: object) -> str:
    """A value as the user wrote it in YAML, with its YAML kind, for "got …" in messages."""
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return f"{str(value).lower()} (a boolean)"
    if isinstance(value, int):
        return f"{value} (an integer)"
    if isinstance(value, float):
        return f"{value} (a number)"
    if isinstance(value, str):
        text = value if len(value) <= 60 else value[:57] + "..."
        return repr(text)
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return f"a {type(value).__name__}"


def dotted(loc: Sequence[str | int]) -> str:
    """A field path as users write it in --override: `compute.num_accelerators`, `include_paths[1]`."""
    out = ""
    for seg in loc:
        if isinstance(seg, int):
            out += f"[{seg}]"
        elif NAME_RE.match(seg):
            out += f".{seg}" if out else seg
        else:
            out += f"[{seg!r}]"
    return out


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a workload: where (field path, YAML line, override) and what."""

    loc: tuple[str | int, ...]
    message: str
    line: int | None = None
    override: str | None = None
    #: The base file (`_bases_`) the line is in; None: the workload file itself.
    file: str | None = None

    def render(self, source: str) -> str:
        where = f"{dotted(self.loc)}: " if self.loc else ""
        text = f"{source}: {where}{self.message}"
        if self.override:
            shown = self.override if len(self.override) <= 200 else f"{self.override[:150]}… ({len(self.override)} characters)"
            text += f" (from --override {shown})"
        elif self.line and self.file:
            text += f" (line {self.line} of {self.file})"
        elif self.line:
            text += f" (line {self.line})"
        return text


def check_name(value: str, what: str) -> str:
    if not value:
        fail("must not be empty")
    if len(value) > MAX_NAME_LENGTH:
        fail(f"is {len(value)} characters long; {what} may have at most {MAX_NAME_LENGTH}")
    if not NAME_RE.match(value):
        bad = ", ".join(repr(c) for c in sorted({c for c in value if not NAME_RE.match(c)}))
        fail(f"may only hold letters, digits, '_' and '-' (not {bad}), got {show_value(value)}")
    return value


def _check_env_name(name: str) -> str:
    if not ENV_NAME_RE.match(name):
        fail(
            f"{name!r} is not a valid environment variable name "
            "(letters, digits and '_', not starting with a digit)"
        )
    if name in RESERVED_ENV_NAMES:
        fail(f"{name} is set by air on every node and cannot be overridden")
    return name


def _env_value(value: object) -> str:
    """Numbers and booleans become strings, as the shell will see them; anything else is an error."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, str):
        return value
    if value is None:
        fail('must be a string, got nothing (null); write NAME: "" for an empty value')
    fail(f"must be a string (numbers and booleans are turned into strings), got {show_value(value)}")


def _secret_ref(value: object) -> str:
    if not isinstance(value, str):
        fail(f"must be a secret reference 'scope/key', got {show_value(value)}")
    parts = value.split("/")
    if len(parts) != 2 or not all(SECRET_PART_RE.match(p) for p in parts):
        fail(
            f"must be a secret reference 'scope/key' (exactly one '/', both parts made of letters, digits, "
            f"'_', '.' and '-'), got {show_value(value)}"
        )
    return value


#: The keys of one `permissions` entry (the hosted product's spelling).
PERMISSION_KEYS = ("user_name", "group_name", "level")
PERMISSION_LEVELS = ("CAN_VIEW", "CAN_MANAGE_RUN", "CAN_MANAGE")
#: Who may be named: a user as `air server token create NAME` takes it, or a group of the server's config.
PRINCIPAL_RE = re.compile(r"^[A-Za-z0-9_.@-]{1,64}$")


def _permission_entry(value: object) -> dict[object, object]:
    """One `permissions` entry: exactly one of user_name / group_name, and a level (hosted spelling; case
    of the level ignored). The hosted product's service principals and IS_OWNER have no meaning here."""
    if not isinstance(value, dict):
        fail(f"must be a mapping like {{user_name: bob, level: CAN_VIEW}}, got {show_value(value)}")
    for key in value:
        if key == "service_principal_name":
            fail("service_principal_name: air has no service principals; name the token's user with user_name")
        if key not in PERMISSION_KEYS:
            import difflib

            close = difflib.get_close_matches(str(key), PERMISSION_KEYS, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            fail(f"unknown key {key!r}{hint} (valid keys: {', '.join(PERMISSION_KEYS)})")
    named = [k for k in ("user_name", "group_name") if value.get(k) is not None]
    if len(named) != 1:
        fail("set exactly one of user_name or group_name " + ("(not both)" if named else "(got neither)"))
    name = value[named[0]]
    if not isinstance(name, str) or not PRINCIPAL_RE.match(name):
        fail(f"{named[0]} must be 1 to 64 letters, digits, '_', '.', '@' or '-', got {show_value(name)}")
    level = value.get("level")
    if level is None:
        fail(f"level is missing: one of {', '.join(PERMISSION_LEVELS)}")
    if isinstance(level, str) and level.strip().upper() in PERMISSION_LEVELS:
        return {**value, "level": level.strip().upper()}
    if isinstance(level, str) and level.strip().upper() == "IS_OWNER":
        fail("level IS_OWNER: a run's owner is the user who submitted it; grant CAN_MANAGE instead")
    fail(f"level must be one of {', '.join(PERMISSION_LEVELS)}, got {show_value(level)}")


#: An environment variable name a workload may set.
EnvName = Annotated[str, AfterValidator(_check_env_name)]
#: An environment variable value (numbers and booleans turned into strings).
EnvValue = Annotated[str, BeforeValidator(_env_value)]
#: `scope/key` in the local secret store.
SecretRef = Annotated[str, BeforeValidator(_secret_ref)]
#: One `permissions` entry as written (checked and its level normalised before the model sees it).
PermissionEntry = BeforeValidator(_permission_entry)

