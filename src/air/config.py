"""The user's configuration, `$AIR_HOME/config.yaml`: profiles (where runs go) and base environments.

A missing or empty file is a valid configuration: the implicit `local` profile and the interpreter air
runs on. Everything is validated here, once, so the rest of air can trust a `Profile` or a base
interpreter path. Example::

    default_profile: cluster
    profiles:
      cluster: {backend: ray, address: "10.0.0.5:6379"}
    environments:
      torch26: {python: /opt/envs/torch26/bin/python}   # named by `environment.version: torch26`
"""

from __future__ import annotations

import difflib
import os
import sys
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from air.errors import UserInputError
from air.home import AirHome
from air.settings import AIR_PROFILE

#: The profile that always exists, even with no configuration file.
LOCAL_PROFILE = "local"


class Profile(BaseModel):
    """Where runs go. `name` is the key under `profiles:`; the Ray backend adds its own fields here."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(default=LOCAL_PROFILE, exclude=True)
    backend: Literal["local", "ray", "server"] = "local"
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


class AirConfig(BaseModel):
    """The whole `config.yaml`. `path` is where it was read from (None: no file, all defaults)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    default_profile: str = LOCAL_PROFILE
    profiles: dict[str, Profile] = Field(default_factory=dict)
    environments: dict[str, BaseEnvironment] = Field(default_factory=dict)
    _path: Path | None = PrivateAttr(default=None)

    @property
    def path(self) -> Path | None:
        return self._path

    @model_validator(mode="before")
    @classmethod
    def _name_profiles(cls, data: Any) -> Any:
        """Give each profile its key as `name`, and add the implicit `local` profile."""
        if not isinstance(data, dict):
            return data
        profiles = data.get("profiles")
        if profiles is None:
            profiles = {}
        if isinstance(profiles, dict):
            named: dict[Any, Any] = {}
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
        return self


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
            "environments.NAME.python.",
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


def _did_you_mean(word: str, choices: Any) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


_TOP_KEYS = ("default_profile", "profiles", "environments")
_SECTION_KEYS = {
    "profiles": tuple(f for f in Profile.model_fields if f != "name"),
    "environments": tuple(BaseEnvironment.model_fields),
}


def _describe(exc: ValidationError) -> str:
    """One line per problem, with the dotted field path and a did-you-mean for unknown keys."""
    lines = []
    for err in exc.errors():
        loc = [str(part) for part in err["loc"]]
        where = ".".join(loc) or "(top level)"
        message = err["msg"]
        if err["type"] == "extra_forbidden" and loc:
            choices = _TOP_KEYS if len(loc) == 1 else _SECTION_KEYS.get(loc[0], ())
            message = "unknown setting." + _did_you_mean(loc[-1], choices)
        elif message.startswith("Value error, "):
            message = message[len("Value error, ") :]
        lines.append(f"  {where}: {message}")
    return "\n".join(lines)


__all__ = [
    "LOCAL_PROFILE",
    "AirConfig",
    "BaseEnvironment",
    "Profile",
    "config_path",
    "load_config",
    "resolve_base_python",
    "resolve_profile",
]
