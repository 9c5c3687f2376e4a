"""Every `AIR_*` environment variable air reads or sets, in one registry.

Three kinds, kept apart so a user knows which ones are theirs to set:

* **settings**: what a user may set to change air's behaviour (docs/reference/settings.md's table is generated from this
  registry: `markdown_table()`);
* **run variables**: what air sets in every node or rank for the user's code to read;
* **internal plumbing**: what air's own processes pass to each other; never set these by hand.

Each variable is a constant named as the variable itself (`AIR_HOME = "AIR_HOME"`), so a grep for the name
finds every use. No module spells an `"AIR_…"` string literal of its own: tests/test_settings.py fails on
one, so a new variable must be registered here (with its kind, default and a one-line doc) first; the
same test fails when docs/reference/settings.md's tables differ from `markdown_table()` (docs/gen_reference.py
writes them).
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass


class Kind(enum.Enum):
    """Who sets a variable (see the module docstring)."""

    SETTING = "setting"
    RUN = "run variable"
    INTERNAL = "internal"


@dataclass(frozen=True)
class EnvVar:
    """One registered variable: its name, kind, default (as a user would read it) and what it does."""

    name: str
    kind: Kind
    default: str
    doc: str


#: Name -> its registration, in the order registered (the reference page's order).
REGISTRY: dict[str, EnvVar] = {}


def _register(name: str, kind: Kind, default: str, doc: str) -> str:
    if not name.startswith("AIR_") or name in REGISTRY:
        raise ValueError(f"bad or duplicate environment variable {name!r}")
    REGISTRY[name] = EnvVar(name, kind, default, doc)
    return name


def _setting(name: str, default: str, doc: str) -> str:
    return _register(name, Kind.SETTING, default, doc)


def _run(name: str, doc: str) -> str:
    return _register(name, Kind.RUN, "set by air", doc)


def _internal(name: str, doc: str) -> str:
    return _register(name, Kind.INTERNAL, "set by air", doc)


# ---- settings: a user may set these ------------------------------------------------------------------

AIR_HOME = _setting(
    "AIR_HOME", "`~/.air`", "Folder of all of air's state: config, run store, logs, MLflow store, caches."
)
AIR_PROFILE = _setting(
    "AIR_PROFILE",
    "the configured default, else `local`",
    "Profile of `config.yaml` to run on (`air -p NAME` wins).",
)
AIR_TRACKING = _setting(
    "AIR_TRACKING",
    "`on`",
    "`off` (or `0`, `false`, `no`) records nothing in MLflow, for workloads and calls alike.",
)
AIR_TRACKING_EARLY_START = _setting(
    "AIR_TRACKING_EARLY_START",
    "`on`",
    "`on`: a workload's local nodes start before the attempt's MLflow run exists (the supervisor makes it "
    "meanwhile) and each node's Python learns its id when it first imports mlflow; the attempt's end is "
    "recorded once the run exists. `off`: nodes start once it exists. Nodes walled in or on Ray always wait.",
)
AIR_CPU_SLOTS = _setting(
    "AIR_CPU_SLOTS", "the CPU count", "CPU slots of this machine: how many CPU ranks/nodes may run at once."
)
AIR_WARM_START = _setting(
    "AIR_WARM_START",
    "`1`",
    "`0` starts every rank of a local call as a fresh interpreter instead of forking it from a warm zygote.",
)
AIR_WARM_IDLE_S = _setting(
    "AIR_WARM_IDLE_S",
    "`600`",
    "Seconds a caller's warm zygote waits idle for its next local call before it ends; `0` keeps none.",
)
AIR_PRELOAD = _setting(
    "AIR_PRELOAD",
    "`auto`",
    "What ranks import before the function runs (a warm zygote: once, before forking): `auto`, `none`, or modules.",
)
AIR_LOG_LEVEL = _setting(
    "AIR_LOG_LEVEL", "`INFO`", "Level of a run's `supervisor.log` (`air run -vv` sets `DEBUG`)."
)
AIR_TERMINATE_GRACE_S = _setting(
    "AIR_TERMINATE_GRACE_S", "`1.0`", "Seconds between SIGTERM and SIGKILL when air ends a process tree."
)
AIR_RELEASE_TIMEOUT_S = _setting(
    "AIR_RELEASE_TIMEOUT_S",
    "`10`",
    "Seconds a rank may take to clean up after it reported its result, before it is ended.",
)
AIR_AGENT_DIR = _setting(
    "AIR_AGENT_DIR",
    "the system temp folder",
    "Where a node keeps its unpacked code and call payloads (`air-agent-<uid>/` below it).",
)
AIR_RAY_TEMP_ROOT = _setting(
    "AIR_RAY_TEMP_ROOT", "the system temp folder", "Where air-started Ray nodes keep their temp folders."
)
AIR_KEEP_RAY_TEMP = _setting(
    "AIR_KEEP_RAY_TEMP",
    "unset",
    "Set (to anything) to keep an air-started Ray node's temp folder after it stops, for debugging.",
)
AIR_RAY_OBJECT_STORE_MEMORY = _setting(
    "AIR_RAY_OBJECT_STORE_MEMORY",
    "Ray's (30% of RAM)",
    "Object store size in bytes of the Ray nodes `ray_launch` starts.",
)
AIR_RAY_JOIN_TIMEOUT_S = _setting(
    "AIR_RAY_JOIN_TIMEOUT_S",
    "`120`",
    "Seconds `ray_launch`'s head waits for every node to join before running the driver anyway.",
)
AIR_RAY_METRICS = _setting(
    "AIR_RAY_METRICS", "`1`", "`0` keeps Ray's metrics out of MLflow in `ray_launch` calls."
)
AIR_SERVER_URL = _setting(
    "AIR_SERVER_URL",
    "unset",
    "An `air server` to send `air run/list/get/logs/cancel/secrets` to (with AIR_TOKEN); wins over profiles.",
)
AIR_TOKEN = _setting("AIR_TOKEN", "unset", "The bearer token for AIR_SERVER_URL (`air server token create`).")
AIR_RAY_TRAIN_MLFLOW = _setting(
    "AIR_RAY_TRAIN_MLFLOW",
    "`1`",
    "`0` stops Ray Train's `report()` metrics from being logged to the attempt's MLflow run.",
)
AIR_ISOLATION_UNAVAILABLE = _setting(
    "AIR_ISOLATION_UNAVAILABLE",
    "unset",
    "`1` makes `air server start` act as if this machine could not isolate runs (no root, no user namespaces).",
)

# ---- run variables: air sets these for the user's code ------------------------------------------------

AIR_RUN_ID = _run("AIR_RUN_ID", "The run's id, in every node of a workload and every rank of a remote call.")
AIR_ATTEMPT = _run(
    "AIR_ATTEMPT", "The attempt's index (0-based; a retry is the next one), in every node and rank of a run."
)
AIR_ACCELERATOR_TYPE = _run(
    "AIR_ACCELERATOR_TYPE", "The run's accelerator type, e.g. `GPU_8xH100` or `CPU_2xCPU`."
)
AIR_ACCELERATOR_KIND = _run(
    "AIR_ACCELERATOR_KIND", "`GPU` or `CPU`: picks the torch.distributed backend (nccl or gloo)."
)
AIR_CHECKPOINT_DIR = _run(
    "AIR_CHECKPOINT_DIR",
    "A folder (or URI) that outlives the run's attempts, for checkpoints; the same in every attempt, node and rank.",
)
AIR_RESUMED = _run("AIR_RESUMED", "`1` in a retried attempt (AIR_ATTEMPT > 0): resume from AIR_CHECKPOINT_DIR.")
AIR_SWEEP_INDEX = _run(
    "AIR_SWEEP_INDEX", "In a child run of a `for_each` sweep: its item's index (0-based, in the order of the items)."
)
AIR_SWEEP_RUN_ID = _run("AIR_SWEEP_RUN_ID", "In a child run of a `for_each` sweep: the sweep's (the parent's) run id.")
AIR_NODE_SLOTS = _run(
    "AIR_NODE_SLOTS",
    "The slots of this machine a local node holds (comma-separated), for a workload that starts Ray.",
)

# ---- internal plumbing: air's processes pass these to each other --------------------------------------

AIR_PROCESS_TAG = _internal(
    "AIR_PROCESS_TAG",
    "Marks every process of one launch, so a teardown finds the ones that left the process group.",
)
AIR_WARM_TAG_SLOT = _internal(
    "AIR_WARM_TAG_SLOT",
    "Room in a kept zygote's environment block where each launch writes its AIR_PROCESS_TAG.",
)
AIR_LAUNCHER_PID = _internal("AIR_LAUNCHER_PID", "The pid a rank must not outlive (its launcher or zygote).")
AIR_SUPERVISOR = _internal(
    "AIR_SUPERVISOR", "Set in a run's supervisor process (its run id); not passed on to the nodes."
)
AIR_RANK_PRELOAD = _internal(
    "AIR_RANK_PRELOAD",
    "Modules a rank imports first (comma-separated), chosen by the caller from AIR_PRELOAD.",
)
AIR_SYS_PATH = _internal(
    "AIR_SYS_PATH",
    "The caller's `sys.path` (JSON), so a rank imports the function's module as the caller did.",
)
AIR_CALL_DIR = _internal("AIR_CALL_DIR", "A call's folder (payload, outcomes) as a rank sees it.")
AIR_MLFLOW_ENV_FILE = _internal(
    "AIR_MLFLOW_ENV_FILE", "File with a recorded call's MLflow variables, read by each rank at start."
)
AIR_MLFLOW_DOOR = _internal(
    "AIR_MLFLOW_DOOR",
    "Set by `air server` for its supervisors: the MLflow address (`<public URL>/mlflow`) handed to nodes.",
)
AIR_MLFLOW_HOLD = _internal(
    "AIR_MLFLOW_HOLD",
    "A file: `air server` reports its MLflow as starting until it exists, even once MLflow answers (tests "
    "use it to see the server serve before MLflow is ready).",
)
AIR_SUPERVISOR_ONLY = _internal(
    "AIR_SUPERVISOR_ONLY",
    "Set by `air server`: the variables (comma-separated) it gave its supervisors only (their MLflow credential, "
    "TLS trust); removed, with itself, from every node's and rank's environment.",
)
AIR_ISOLATION = _internal(
    "AIR_ISOLATION",
    "Set by `air server` for its supervisors and call drivers: the walls its runs get (`unix-user+bwrap`, `bwrap`, "
    "or `none (...)`); where set, a node's and a rank's environment is the clean base (node_environ).",
)
AIR_FORWARD_ENV = _internal(
    "AIR_FORWARD_ENV",
    "Set by `air server`: the variables of its own environment (comma-separated, `server.forward_env` of its "
    "config) that its runs' nodes and ranks also get.",
)
AIR_FAKE_GPUS = _internal(
    "AIR_FAKE_GPUS",
    "Tests only: `N:MODEL` pretends this machine has N such GPUs (nothing checks they exist).",
)
AIR_TRACKING_GIVE_UP_S = _internal(
    "AIR_TRACKING_GIVE_UP_S",
    "Tests only: caps (never lengthens) each of a supervisor's waits, at an attempt's end, for its MLflow run "
    "to be made through a tracking server that is away, and its nodes' wait for that run at `import mlflow`, so "
    "a test sees the give-up (and the later back-fill) soon.",
)
AIR_RAY_NODE = _internal(
    "AIR_RAY_NODE", "Carried by every process of one air-started Ray node, so stopping it ends them all."
)
AIR_RAY_HEAD_PORT = _internal(
    "AIR_RAY_HEAD_PORT", "The GCS port the `ray` shim moves `ray start --head` to (free on node 0)."
)
AIR_RAY_SHIM_DIR = _internal(
    "AIR_RAY_SHIM_DIR", "Folder of the `ray` shim put first on a workload node's PATH."
)
AIR_RAY_METRICS_PORT = _internal(
    "AIR_RAY_METRICS_PORT", "This node's Ray metrics export port, for RayMetricsMonitor."
)
AIR_HEARTBEAT_FILE = _internal(
    "AIR_HEARTBEAT_FILE", "A process's 8-byte progress slot, written by `air.runtime.heartbeat()`, read by its launcher."
)
AIR_STACKS_FILE = _internal(
    "AIR_STACKS_FILE", "Where a rank writes its stacks on SIGUSR2 (the fallback when py-spy is missing)."
)
AIR_PATH_PREFIX = _internal(
    "AIR_PATH_PREFIX", "A folder the Ray node agent puts first on a node process's PATH."
)


#: How a yes/no setting is written (case and surrounding space aside).
SWITCHED_ON = ("1", "on", "true", "yes")
SWITCHED_OFF = ("0", "off", "false", "no")


def switched(name: str, default: bool, env: Mapping[str, str] | None = None) -> bool:
    """A yes/no setting: on for SWITCHED_ON, off for SWITCHED_OFF, `default` when unset or unrecognized."""
    value = (os.environ if env is None else env).get(name, "").strip().lower()
    return True if value in SWITCHED_ON else False if value in SWITCHED_OFF else default


#: What a node or rank of a run of `air server` gets from the server's own environment, besides air's own
#: variables, MLflow's and the names the operator forwards (`server.forward_env`): an operator's cloud keys,
#: tokens and the like never reach a user's code unless named.
BASE_ENV = ("PATH", "HOME", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "LC_MESSAGES", "TZ", "TERM", "USER",
            "LOGNAME", "SHELL", "TMPDIR", "CUDA_VISIBLE_DEVICES")
#: Registered variables a server's own environment may hold that are the operator's, not air's for a run:
#: its client settings (another server's address and token).
_OPERATOR_ONLY = ("AIR_SERVER_URL", "AIR_TOKEN", "AIR_PROFILE")


def node_environ(env: Mapping[str, str]) -> dict[str, str]:
    """`env` without what `air server` gave its supervisors and call drivers only (AIR_SUPERVISOR_ONLY):
    the one rule every builder of a node's or rank's environment applies, so no node ever holds the
    server's MLflow credential or its supervisors' TLS exceptions. Under a server (AIR_ISOLATION set, any
    mode), only the clean base: BASE_ENV, air's registered variables, MLflow's (`MLFLOW_*`) and the names in
    AIR_FORWARD_ENV; a local run (no server) keeps the user's whole environment."""
    drop = {AIR_SUPERVISOR_ONLY, *(k for k in env.get(AIR_SUPERVISOR_ONLY, "").split(",") if k)}
    kept = {k: v for k, v in env.items() if k not in drop}
    if not env.get(AIR_ISOLATION):
        return kept
    forward = {k for k in env.get(AIR_FORWARD_ENV, "").split(",") if k}
    return {k: v for k, v in kept.items()
            if k in BASE_ENV or k in forward or k.startswith("MLFLOW_")
            or (k in REGISTRY and k not in _OPERATOR_ONLY and k not in (AIR_ISOLATION, AIR_FORWARD_ENV))}


def of_kind(kind: Kind) -> list[EnvVar]:
    """The registered variables of one kind, in registration order."""
    return [v for v in REGISTRY.values() if v.kind is kind]


def markdown_table(kind: Kind = Kind.SETTING) -> str:
    """The reference page's table of one kind of variable (generated, so it cannot drift from the registry)."""
    with_default = kind is Kind.SETTING
    head = (
        "| variable | default | what it does |\n|---|---|---|"
        if with_default
        else "| variable | what it is |\n|---|---|"
    )
    rows = [
        f"| `{v.name}` | {v.default} | {v.doc} |" if with_default else f"| `{v.name}` | {v.doc} |"
        for v in of_kind(kind)
    ]
    return "\n".join([head, *rows])
