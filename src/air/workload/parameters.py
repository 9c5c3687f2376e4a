"""The workload's `parameters:` map, written to the YAML file that HYPERPARAMETERS_PATH points to.

The user's code reads it back with whatever YAML loader it likes (PyYAML, OmegaConf, ruamel), so the file
must mean the same to all of them: strings that a YAML 1.2 reader would take for numbers (`1e3`, `0x1F`)
are quoted, and `yaml.safe_load` returns exactly the map that was written (tuples become lists).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import yaml

from air.errors import UserInputError
from air.files import atomic_write_text

# Plain scalars that PyYAML reads as strings but YAML 1.2 loaders read as numbers.
_NUMBER_LIKE = re.compile(
    r"""^[-+]?(
        [0-9][0-9_]*(\.[0-9_]*)?([eE][-+]?[0-9]+)?
      | \.[0-9]+([eE][-+]?[0-9]+)?
      | 0x[0-9a-fA-F]+ | 0o[0-7]+
      | \.inf | \.nan
    )$""",
    re.VERBOSE | re.IGNORECASE,
)


class _Dumper(yaml.SafeDumper):
    """SafeDumper that quotes number-like strings, so every YAML loader reads them back as strings."""


def _represent_str(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
    if _NUMBER_LIKE.match(data):
        return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="'")
    return dumper.represent_str(data)


_Dumper.add_representer(str, _represent_str)


def write_parameters(parameters: Mapping[str, object], path: Path) -> Path:
    """Write `parameters` as YAML to `path` atomically (temporary file + rename) and return the path."""
    if not isinstance(parameters, Mapping):
        raise UserInputError(f"parameters: must be a map, got {type(parameters).__name__}")
    try:
        text = yaml.dump(
            dict(parameters),
            Dumper=_Dumper,
            sort_keys=False,
            default_flow_style=False,
            allow_unicode=True,
            width=1 << 20,
        )
    except yaml.YAMLError as exc:
        where = _unrepresentable(parameters, "parameters") or "parameters"
        raise UserInputError(f"{where}: cannot be written to YAML ({exc})") from exc
    return atomic_write_text(Path(path), text)


def _unrepresentable(value: object, where: str) -> str | None:
    """The dotted path of the first value safe YAML cannot hold, for the error message."""
    try:
        yaml.dump(value, Dumper=_Dumper)
        return None
    except yaml.YAMLError:
        pass
    if isinstance(value, Mapping):
        for k, v in value.items():
            found = _unrepresentable(v, f"{where}.{k}")
            if found:
                return found
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            found = _unrepresentable(v, f"{where}[{i}]")
            if found:
                return found
    return where

