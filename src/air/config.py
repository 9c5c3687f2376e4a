"""The user's configuration, `$AIR_HOME/config.yaml`: profiles (where runs go) and base environments.

A missing or empty file is a valid configuration: the implicit `local` profile and the interpreter air
runs on. Everything is validated here, once, so the rest of air can trust a `Profile` or a base
interpreter path. Example::

    default_profile: cluster
    profiles:
      cluster: {backend: ray, address: "10.0.0.5:6379"}
    environments:
      torch26: {python: /opt/envs/torch26/bin/python}   # named by `environment.version: torch26`
    groups:
      ml: [alice, bob]                 # a workload's `permissions` may name `group_name: ml`
    server:
      default_visibility: private      # `air server`: runs are seen by owner, admins and their permissions
      forward_env: [HF_HOME]           # `air server`: what of its own environment its runs also get
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from air.errors import UserInputError
from air.home import AirHome
from air.settings import AIR_PROFILE

#: The profile that always exists, even with no configuration file.
LOCAL_PROFILE = "local"
#: The one pool when none is configured: every slot of this machine.
DEFAULT_POOL = "default"
#: The pools DATABRICKS_USE_RESERVED_GPU_POOL picks (seed 001: true → reserved, false → on-demand).
RESERVED_POOL, ON_DEMAND_POOL = "reserved", "on-demand"
USE_RESERVED_POOL = "DATABRICKS_USE_RESERVED_GPU_POOL"
#: The hosted product's explicit pool of a `remote=True` call: here the name of a pool under `pools:`.
REMOTE_POOL_ID = "DATABRICKS_REMOTE_GPU_POOL_ID"


class Profile(BaseModel):
    """Where runs go. `name` is the key under `profiles:`; the Ray backend adds its own fields here."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(default=LOCAL_PROFILE, exclude=True)
    backend: Literal["local", "ray", "server", "slurm"] = "local"
    #: Ray: the cluster address (`host:port`, `ray://host:port`, or `auto`). Unused by `local`.
    address: str | None = None
    #: Ray: the cluster's auth token file (RAY_AUTH_MODE=token); unset: the environment's Ray auth settings.
    auth_token_path: str | None = None
    #: Ray: "auto" ships the code snapshot only to nodes that lack its path; "always" ships it everywhere.
    code_shipping: Literal["auto", "always"] | None = None
    #: Where runs keep checkpoints across attempts (AIR_CHECKPOINT_DIR = <root>/<run id>): a folder every
    #: node mounts, or a URI (`s3://...`, `gs://...`) for fsspec/pyarrow. Unset: `$AIR_HOME/runs/<id>/checkpoints`.
    checkpoint_root: str | None = None
    #: Server: the `air server` address (`http://host:8765`); runs go there instead of this machine.
    url: str | None = None
    #: Server: a file holding this user's token (from `air server token create`).
    token_path: str | None = None
    #: Slurm (docs/slurm.md): sbatch's --partition, --account, --qos, --constraint, --reservation and --time
    #: (minutes, or Slurm's "D-HH:MM:SS") of every job of the profile's runs; a run's `slurm:` section wins.
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    reservation: str | None = None
    time_limit: str | int | None = None
    #: Slurm: the interpreter the job's nodes run air's node launcher with, first on a workload command's PATH
    #: (an air installation on the cluster's shared filesystem). Unset: the submitting air's own. Under a
    #: walled `air server` every run's account must be able to run it.
    node_python: str | None = None
    #: Slurm under a walled `air server` (docs/slurm.md): a folder on the cluster's shared filesystem, the
    #: server's account's and writable by no one else, where each job gets a folder of its run's account (0700).
    work_root: str | None = None

    @model_validator(mode="after")
    def _server_needs_url(self) -> Profile:
        if self.backend == "server" and not (self.url and self.token_path):
            raise ValueError("a server profile needs url (http://host:8765) and token_path (a file with the token)")
        return self


class BaseEnvironment(BaseModel):
    """A base interpreter that `environment.version` can name; dependencies are layered on top of it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: An interpreter, or a virtual environment folder (its `bin/python` is used).
    python: str


class Pool(BaseModel):
    """A named share of capacity that runs ask for (`compute.pool`): this machine's slots (`slots`; runs
    wait in one first-in-first-out queue per pool and claim only its slots), or the Ray nodes whose labels
    include `ray_labels` (a Ray profile; Ray places the run's nodes only there)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(default=DEFAULT_POOL, exclude=True)
    #: Which slots: GPU (this machine's GPUs, by index) or CPU (AIR_CPU_SLOTS processes).
    accelerator: Literal["GPU", "CPU"]
    #: Slot indices: a range "0-3", a list [0, 2], or "0,2,5".
    slots: list[int] | None = None
    #: Ray: the node labels (`ray start --labels pool=reserved`) that select the pool's nodes.
    ray_labels: dict[str, str] | None = None

    @property
    def on_ray(self) -> bool:
        return self.ray_labels is not None

    @field_validator("accelerator", mode="before")
    @classmethod
    def _upper(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value

    @field_validator("slots", mode="before")
    @classmethod
    def _parse_slots(cls, value: object) -> object:
        if isinstance(value, int) and not isinstance(value, bool):
            value = [value]
        if isinstance(value, str):
            out: list[int] = []
            for part in (p.strip() for p in value.split(",")):
                first, dash, last = part.partition("-")
                if not (first.strip().isdigit() and (not dash or last.strip().isdigit())):
                    raise ValueError(f"{value!r} is not a slot range: write \"0-3\", \"0,2\" or a list [0, 2]")
                lo, hi = int(first), int(last) if dash else int(first)
                if hi < lo:
                    raise ValueError(f"{part!r}: a range goes low-high, like 0-3")
                out.extend(range(lo, hi + 1))
            value = out
        return value

    @model_validator(mode="after")
    def _distinct_slots(self) -> Pool:
        if (self.slots is None) == (self.ray_labels is None):
            raise ValueError("a pool has either slots (this machine's) or ray_labels (Ray nodes), not both")
        if self.ray_labels is not None:
            if not self.ray_labels:
                raise ValueError("ray_labels needs at least one label (key: value)")
            return self
        if not self.slots:
            raise ValueError("a pool needs at least one slot")
        if any(i < 0 for i in self.slots) or len(set(self.slots)) != len(self.slots):
            raise ValueError(f"slots must be distinct indices >= 0, got {self.slots}")
        return self


#: Group and user names in `groups:` (a user name is what `air server token create NAME` accepts).
_GROUP_RE = re.compile(r"^[A-Za-z0-9_.@-]{1,64}$")
#: `server.forward_env` names and `server.account_prefix` (room left for the user's name in 32 characters).
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_PREFIX_RE = re.compile(r"^[a-z_][a-z0-9_-]{0,15}$")


_SIZE_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*(B|K|KB|KiB|M|MB|MiB|G|GB|GiB|T|TB|TiB)?$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 10**3, "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
          "g": 1 << 30, "gib": 1 << 30, "gb": 10**9, "t": 1 << 40, "tib": 1 << 40, "tb": 10**12}


def _size(value: object, *, percent_of: str | None) -> int | str | None:
    """A size setting: bytes (an integer), "200MiB", "4GiB", "2GB", or (where `percent_of` names what of)
    "50%"; None (null) turns the limit off."""
    if value is None or isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if isinstance(value, str):
        text = value.strip()
        if percent_of and text.endswith("%"):
            try:
                share = float(text[:-1])
            except ValueError:
                share = -1.0
            if 0 < share <= 100:
                return f"{share:g}%"
        match = _SIZE_RE.match(text)
        if match and float(match.group(1)) > 0:
            return int(float(match.group(1)) * _UNITS[(match.group(2) or "").lower()])
    also = f", or a share of {percent_of} such as \"50%\"" if percent_of else ""
    raise ValueError(f"must be a size such as 200MiB, 4GiB or a number of bytes{also} (null: no limit), got {value!r}")


class ServerLimits(BaseModel):
    """`server.limits`: what each run of `air server` may use (isolation on; docs/server.md, "Limits").
    Memory and processes are per node (a cgroup each), disk per run (its scratch and checkpoints, watched),
    blobs per user (uploaded code snapshots). null turns one off."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: Memory of one node, swap included: a size, or a share of this machine's memory ("80%").
    memory_per_node: int | str | None = "80%"
    #: Processes (threads included) of one node at once: a fork bomb stops here.
    pids_per_node: int | None = Field(default=4096, gt=0)
    #: A run's scratch and checkpoints together: a size, or a share of the disk that holds them ("20%").
    disk_per_run: int | str | None = "20%"
    #: Bytes of uploaded blobs (code snapshots) one user may keep on the server.
    blob_quota_per_user: int | None = 2 << 30

    @field_validator("memory_per_node", mode="before")
    @classmethod
    def _memory(cls, value: object) -> object:
        return _size(value, percent_of="this machine's memory")

    @field_validator("disk_per_run", mode="before")
    @classmethod
    def _disk(cls, value: object) -> object:
        return _size(value, percent_of="the disk that holds the run's folders")

    @field_validator("blob_quota_per_user", mode="before")
    @classmethod
    def _blobs(cls, value: object) -> object:
        return _size(value, percent_of=None)

    @staticmethod
    def in_bytes(value: int | str | None, total: int) -> int | None:
        """A size setting in bytes; a share ("50%") of `total`."""
        if isinstance(value, str):
            return int(total * float(value.rstrip("%")) / 100)
        return value


class ServerSettings(BaseModel):
    """`server:`: how `air server` (serving this AIR_HOME) treats its users."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: Who sees a run besides its owner, admins and its `permissions`: `team` (every signed-in user, the
    #: default) or `private` (no one else; a run one may not see is not found).
    default_visibility: Literal["team", "private"] = "team"

    @field_validator("default_visibility", mode="before")
    @classmethod
    def _visibility(cls, value: object) -> object:
        if isinstance(value, str) and value.strip().lower() in ("team", "private"):
            return value.strip().lower()
        raise ValueError(f"must be team (every signed-in user sees every run) or private (only the owner, admins "
                         f"and the run's permissions), got {value!r}")

    #: Variables of the server's own environment its runs' nodes and ranks also get (by name; nothing else of
    #: it reaches a run but a fixed base, air's and MLflow's variables: air.settings.node_environ).
    forward_env: tuple[str, ...] = ()
    #: Prefix of the Unix accounts air creates for this server's users (`<prefix><user>`); default
    #: `air-<6 hex of this AIR_HOME's path>-`, so two servers on one host never share an account.
    account_prefix: str | None = None
    #: What each run may use: memory, processes, disk; uploaded blobs per user (`server.limits`).
    limits: ServerLimits = Field(default_factory=ServerLimits)

    @field_validator("forward_env", mode="before")
    @classmethod
    def _forward_env(cls, value: object) -> object:
        if value is None:
            return ()
        if not isinstance(value, list | tuple):
            raise ValueError(f"must be a list of environment variable names, e.g. [HF_HOME], got {value!r}")
        for name in value:
            if not isinstance(name, str) or not _ENV_NAME_RE.match(name):
                raise ValueError(f"{name!r} is not an environment variable name (letters, digits and '_', not "
                                 "starting with a digit), e.g. HF_HOME")
            if name.startswith("AIR_"):
                raise ValueError(f"{name}: air's own variables are air's to give a run, not forwarded")
        return tuple(dict.fromkeys(value))

    @field_validator("account_prefix", mode="before")
    @classmethod
    def _account_prefix(cls, value: object) -> object:
        if value is None:
            return None
        if not isinstance(value, str) or not _PREFIX_RE.match(value):
            raise ValueError(f"must be 1 to 16 lowercase letters, digits, '_' or '-', starting with a letter or "
                             f"'_' (a Unix account name's start, e.g. air-lab1-), got {value!r}")
        return value


class AirConfig(BaseModel):
    """The whole `config.yaml`. `path` is where it was read from (None: no file, all defaults)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    default_profile: str = LOCAL_PROFILE
    profiles: dict[str, Profile] = Field(default_factory=dict)
    environments: dict[str, BaseEnvironment] = Field(default_factory=dict)
    #: Named pools of this machine's slots (none: one implicit pool, the whole machine).
    pools: dict[str, Pool] = Field(default_factory=dict)
    #: The pool of a run that names none (required with two or more pools).
    default_pool: str | None = None
    #: Most runs one user may hold running at once, over all pools; the rest wait (others' runs go by).
    max_running_runs_per_user: int | None = Field(default=None, gt=0)
    #: Groups a workload's `permissions` may name (`group_name`): NAME → the users in it.
    groups: dict[str, list[str]] = Field(default_factory=dict)
    #: `air server` settings (default visibility of runs).
    server: ServerSettings = Field(default_factory=ServerSettings)
    _path: Path | None = PrivateAttr(default=None)

    @property
    def path(self) -> Path | None:
        return self._path

    @field_validator("groups", mode="before")
    @classmethod
    def _groups(cls, value: object) -> object:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ValueError("must be a mapping of group name to a list of user names, e.g. {ml: [alice, bob]}")
        out: dict[str, list[str]] = {}
        for name, members in value.items():
            if not isinstance(name, str) or not _GROUP_RE.match(name):
                raise ValueError(f"group name {name!r} is not valid: 1 to 64 letters, digits, '_', '.', '@' or '-'")
            if members is None:
                members = []
            if not isinstance(members, list):
                raise ValueError(f"{name}: must be a list of user names, e.g. [alice, bob], got {members!r}")
            bad = [m for m in members if not isinstance(m, str) or not _GROUP_RE.match(m)]
            if bad:
                raise ValueError(f"{name}: {bad[0]!r} is not a user name (1 to 64 letters, digits, '_', '.', '@' "
                                 "or '-', as `air server token create NAME` takes)")
            out[name] = list(dict.fromkeys(members))
        return out

    @field_validator("server", mode="before")
    @classmethod
    def _server(cls, value: object) -> object:
        return {} if value is None else value

    @model_validator(mode="before")
    @classmethod
    def _name_profiles(cls, data: object) -> object:
        """Give each profile its key as `name`, and add the implicit `local` profile."""
        if not isinstance(data, dict):
            return data
        profiles = data.get("profiles")
        if profiles is None:
            profiles = {}
        pools = data.get("pools")
        if isinstance(pools, dict):
            data = {**data, "pools": {
                key: {**value, "name": str(key)} if isinstance(value, dict) and "name" not in value else value
                for key, value in pools.items()
            }}
        if isinstance(profiles, dict):
            named: dict[object, object] = {}
            for key, value in profiles.items():
                if isinstance(value, dict):
                    if "name" in value:
                        raise ValueError(f"profiles.{key}: 'name' is not a setting, the key {key!r} is the name")
                    value = {**value, "name": str(key)}
                elif value is None:
                    value = {"name": str(key)}
                named[key] = value
            named.setdefault(LOCAL_PROFILE, {"name": LOCAL_PROFILE, "backend": "local"})
            data = {**data, "profiles": named}
        return data

    @model_validator(mode="after")
    def _default_exists(self) -> AirConfig:
        if self.default_profile not in self.profiles:
            raise ValueError(
                f"default_profile {self.default_profile!r} is not one of the profiles "
                f"({', '.join(sorted(self.profiles))})"
            )
        if self.default_pool is not None and self.default_pool not in self.pools:
            raise ValueError(f"default_pool {self.default_pool!r} is not one of the pools "
                             f"({', '.join(self.pools) or 'none configured'})")
        if len(self.pools) > 1 and self.default_pool is None:
            raise ValueError(f"default_pool is required with several pools: name the one for runs that ask for "
                             f"none ({', '.join(self.pools)})")
        taken: dict[tuple[str, int], str] = {}
        if len({pool.on_ray for pool in self.pools.values()}) > 1:
            raise ValueError("pools are all of slots or all of ray_labels (one backend serves them)")
        for pool in self.pools.values():
            for index in pool.slots or ():
                other = taken.setdefault((pool.accelerator, index), pool.name)
                if other != pool.name:
                    raise ValueError(f"pools {other!r} and {pool.name!r} both hold {pool.accelerator} slot {index}; "
                                     "a slot belongs to one pool")
        return self

    @property
    def pool_names(self) -> list[str]:
        return list(self.pools) or [DEFAULT_POOL]

    def resolve_pool(self, asked: str | None, kind: str, *, use_reserved: bool | None = None,
                     asked_by: str = "compute.pool") -> str | None:
        """The pool a run of `kind` ('GPU'/'CPU') goes to: `compute.pool`, else DATABRICKS_USE_RESERVED_GPU_POOL
        (true: `reserved`; false: `on-demand` where configured), else `default_pool` (or the only pool), or
        the first pool of its kind when that one is of the other kind. None: no pool of its kind (it
        claims among all of this machine's slots of its kind, as without pools). An unknown pool is a
        UserInputError listing the pools."""
        source = asked_by
        if asked is None and use_reserved is not None:
            source = f"{USE_RESERVED_POOL}={'1' if use_reserved else '0'}"
            asked = RESERVED_POOL if use_reserved else (ON_DEMAND_POOL if ON_DEMAND_POOL in self.pools else None)
        if asked is None:
            default = self.default_pool or next(iter(self.pools), None)
            if default is not None and self.pools[default].accelerator != kind.upper():
                default = next(iter(self.pools_of(kind.upper())), None)
            return default
        if asked in self.pools or (not self.pools and asked == DEFAULT_POOL):
            return asked if self.pools else None
        raise UserInputError(
            f"Unknown pool {asked!r} (from {source}). Pools: {', '.join(self.pool_names)}."
            + _did_you_mean(asked, self.pool_names),
            hint="Name one of these in compute.pool, or add the pool under `pools:` in the config.yaml of "
            "the AIR_HOME runs go to (the server's, through `air server`).",
        )

    def call_pool(self, backend: str, accelerator_kind: str, wanted: int, use_reserved: bool | None,
                  asked: str | None = None) -> str | None:
        """The pool of a `@distributed(remote=True)` call (DATABRICKS_REMOTE_GPU_POOL_ID, else
        DATABRICKS_USE_RESERVED_GPU_POOL, else the default pool), checked as a workload's is; None without
        pools for its backend."""
        if (backend == "local") == self.ray_pools:
            return None
        pool = self.resolve_pool(asked, accelerator_kind, use_reserved=use_reserved, asked_by=REMOTE_POOL_ID)
        self.check_pool_fits(pool, accelerator_kind, wanted)
        return pool

    @property
    def ray_pools(self) -> bool:
        return any(pool.on_ray for pool in self.pools.values())

    def check_pool_fits(self, pool: str | None, kind: str, wanted: int) -> None:
        """The run's kind is the pool's and the pool has room for it at all (else it would wait forever)."""
        if pool is None:
            return
        chosen = self.pools[pool]
        if chosen.on_ray:
            if chosen.accelerator != kind.upper():
                raise UserInputError(f"Pool {pool!r} has {chosen.accelerator} nodes; this run needs {kind.upper()}.",
                                     hint=f"Pick a pool of {kind.upper()} ({', '.join(self.pools_of(kind.upper())) or 'none'}).")
            return
        slots = self.pool_slots(pool, kind, 0)
        if wanted > len(slots):
            raise UserInputError(
                f"The run needs {wanted} {kind.upper()} slots but pool {pool!r} has {len(slots)}; it could never "
                "start there.", hint="Ask for fewer accelerators, or another pool (`air get pools`).")

    def pool_slots(self, pool: str | None, kind: str, capacity: int) -> list[int]:
        """The slot indices of `kind` a run of `pool` may claim (None or no pools: all `capacity`)."""
        if pool is None or not self.pools:
            return list(range(capacity))
        chosen = self.pools.get(pool)
        if chosen is None:
            raise UserInputError(f"The run's pool {pool!r} is no longer configured ({', '.join(self.pool_names)}).")
        if chosen.accelerator != kind.upper():
            raise UserInputError(
                f"Pool {pool!r} has {chosen.accelerator} slots; this run needs {kind.upper()} slots.",
                hint=f"Pick a pool of {kind.upper()} slots ({', '.join(self.pools_of(kind.upper())) or 'none'}).")
        if chosen.slots is None:
            raise UserInputError(f"Pool {pool!r} is of Ray nodes (ray_labels), not of this machine's slots.")
        return list(chosen.slots)

    def pools_of(self, kind: str) -> list[str]:
        return [name for name, pool in self.pools.items() if pool.accelerator == kind]

    def check_pools(self, capacities: dict[str, int]) -> None:
        """Every pool's slots exist on this machine (`air server start` checks before serving)."""
        for pool in self.pools.values():
            have = capacities.get(pool.accelerator, 0)
            beyond = [i for i in pool.slots or () if i >= have]
            if beyond:
                raise UserInputError(
                    f"Pool {pool.name!r} names {pool.accelerator} slot(s) {','.join(map(str, beyond))}, but this "
                    f"machine has {have} {pool.accelerator} slot(s)" + (f" (0-{have - 1})." if have else "."),
                    hint=f"Fix pools.{pool.name}.slots in {self.path or config_path()}"
                    + (" or raise AIR_CPU_SLOTS." if pool.accelerator == "CPU" else "."))


def use_reserved_pool() -> bool | None:
    """DATABRICKS_USE_RESERVED_GPU_POOL as the seed's notebooks set it ('1'/'True' or '0'/'False'); None: unset."""
    raw = os.environ.get(USE_RESERVED_POOL, "").strip().lower()
    if not raw:
        return None
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise UserInputError(f"{USE_RESERVED_POOL}={os.environ[USE_RESERVED_POOL]!r} is neither true nor false.",
                         hint="Set it to 1/True (the reserved pool) or 0/False (on-demand), or unset it.")


def remote_pool_id() -> str | None:
    """DATABRICKS_REMOTE_GPU_POOL_ID as the caller set it; None: unset."""
    return os.environ.get(REMOTE_POOL_ID, "").strip() or None


def config_path() -> Path:
    """`$AIR_HOME/config.yaml` (it need not exist)."""
    return AirHome(create=False).config


def load_config(path: Path | None = None) -> AirConfig:
    """Read and validate the configuration; every problem is a UserInputError that names the file."""
    path = path or config_path()
    if not path.exists():
        return AirConfig()
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise UserInputError(f"Cannot read the air configuration {path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise UserInputError(f"{path} is not valid YAML: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UserInputError(
            f"{path} must be a mapping (default_profile, profiles, environments), got {type(data).__name__}."
        )
    try:
        config = AirConfig.model_validate(data)
    except ValidationError as exc:
        raise UserInputError(
            f"Invalid air configuration {path}:\n{_describe(exc)}",
            hint=f"Settings: default_profile, profiles.NAME.{{{', '.join(_SECTION_KEYS['profiles'])}}}, "
            "environments.NAME.python, pools.NAME.{accelerator, slots | ray_labels}, default_pool, max_running_runs_per_user, "
            "groups.NAME: [users], server.{default_visibility, forward_env, account_prefix, limits}.",
        ) from None
    config._path = path
    return config


def resolve_profile(name: str | None = None, config: AirConfig | None = None) -> Profile:
    """The profile to use: `name` (from `-p`), else AIR_PROFILE, else the configured default."""
    config = config or load_config()
    chosen = name or os.environ.get(AIR_PROFILE) or config.default_profile
    profile = config.profiles.get(chosen)
    if profile is None:
        source = "-p" if name else AIR_PROFILE if os.environ.get(AIR_PROFILE) else "default_profile"
        raise UserInputError(
            f"Unknown profile {chosen!r} (from {source}). Known profiles: {', '.join(sorted(config.profiles))}."
            + _did_you_mean(chosen, config.profiles),
            hint=f"Add it under `profiles:` in {config.path or config_path()}.",
        )
    return profile


def resolve_base_python(version: str | int | None, config: AirConfig | None = None) -> Path:
    """The base interpreter for `environment.version`: None means the interpreter air runs on."""
    if version is None:
        return Path(sys.executable)
    config = config or load_config()
    name = str(version)
    where = config.path or config_path()
    entry = config.environments.get(name)
    if entry is None:
        known = ", ".join(sorted(config.environments)) or "none"
        raise UserInputError(
            f"environment.version {name!r} is not a configured base environment (configured: {known})."
            + _did_you_mean(name, config.environments),
            hint=f"Add it to {where}:\n  environments:\n    {name}:\n      python: /path/to/bin/python\n"
            "or leave environment.version out to use the interpreter air runs on.",
        )
    python = Path(os.path.expandvars(entry.python)).expanduser()
    if not python.is_absolute():
        python = where.parent / python
    if python.is_dir():
        python = python / "bin" / "python"
    python = Path(os.path.abspath(python))  # keep a venv's own path: resolving links would leave the venv
    if not (python.is_file() and os.access(python, os.X_OK)):
        raise UserInputError(
            f"Base environment {name!r} names {python}, which is not an executable Python interpreter.",
            hint=f"Fix environments.{name}.python in {where}.",
        )
    return python


def _did_you_mean(word: str, choices: Iterable[str]) -> str:

    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


_TOP_KEYS = ("default_profile", "profiles", "environments", "pools", "default_pool", "max_running_runs_per_user",
             "groups", "server")
_SECTION_KEYS = {
    "pools": tuple(f for f in Pool.model_fields if f != "name"),
    "profiles": tuple(f for f in Profile.model_fields if f != "name"),
    "environments": tuple(BaseEnvironment.model_fields),
    "server": tuple(ServerSettings.model_fields),
    "limits": tuple(ServerLimits.model_fields),
}


def _describe(exc: ValidationError) -> str:
    """One line per problem, with the dotted field path and a did-you-mean for unknown keys."""
    lines = []
    for err in exc.errors():
        loc = [str(part) for part in err["loc"]]
        where = ".".join(loc) or "(top level)"
        message = err["msg"]
        if err["type"] == "extra_forbidden" and loc:
            choices = _TOP_KEYS if len(loc) == 1 else _SECTION_KEYS.get("limits" if loc[:2] == ["server", "limits"] else loc[0], ())
            message = "unknown setting." + _did_you_mean(loc[-1], choices)
        elif message.startswith("Value error, "):
            message = message[len("Value error, ") :]
        lines.append(f"  {where}: {message}")
    return "\n".join(lines)


__all__ = [
    "LOCAL_PROFILE",
    "AirConfig",
    "BaseEnvironment",
    "Pool",
    "Profile",
    "ServerLimits",
    "ServerSettings",
    "config_path",
    "load_config",
    "resolve_base_python",
    "resolve_profile",
]
