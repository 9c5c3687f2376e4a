"""`air run --override key.path=value`: change a workload from the command line without editing its YAML.

An override wins over the file. The dotted path is walked over the schema itself (the same model that
validates the file), so a typo is caught with the same "did you mean" as in the YAML, and missing blocks
are created on the way (`code_source.snapshot.root_path=.` needs no `code_source:` in the file). Free-form
maps take any key: `env_variables.NAME=…`, `secrets.NAME=scope/key`, and `parameters.a.b.c=…` at any depth.

Values are read as YAML and then fitted to the field's type, so `compute.num_accelerators=16` is an
integer, `parameters.amp=true` a boolean, `environment.dependencies=[torch, numpy]` a list, while a
string field keeps the text exactly as typed (`experiment_name=123` is the string "123", and
`command=echo hi # note` keeps its "# note").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, get_origin

import yaml
from pydantic import BaseModel

from air.bounds import YamlBoundError, safe_load_bounded
from air.workload.schema import (
    accepts_none,
    annotation_members,
    is_map,
    map_values,
    section_model,
    unknown_key_message,
)
from air.workload.spec import WorkloadSpec
from air.workload.spec_rules import Problem, dotted, show_value


class _OverrideProblem(Exception):
    def __init__(self, loc: tuple[str, ...], message: str) -> None:
        super().__init__(message)
        self.loc = loc
        self.message = message


def parse_override(text: str) -> tuple[tuple[str, ...], str]:
    """Split `a.b.c=value` into its path and raw value; raises ValueError when it has no key."""
    key, sep, raw = text.partition("=")
    path = tuple(part.strip() for part in key.strip().split("."))
    if not sep or not key.strip() or any(not part for part in path):
        raise ValueError(
            f"--override {text!r}: expected KEY=VALUE with a dotted key, e.g. compute.num_accelerators=16"
        )
    return path, raw


def apply_overrides(
    data: dict[str, object], overrides: Sequence[str], model: type[BaseModel] = WorkloadSpec
) -> tuple[dict[str, object], list[Problem], dict[tuple[str, ...], str]]:
    """Apply overrides to raw workload data, in order (a later one wins).

    Returns the data (changed in place), the problems of overrides that could not be applied (each names
    the field path), and the path each applied override set, so errors in its value can blame it.
    """
    problems: list[Problem] = []
    applied: dict[tuple[str, ...], str] = {}
    for text in overrides:
        try:
            path, raw = parse_override(text)
        except ValueError as exc:
            problems.append(Problem((), str(exc)))
            continue
        try:
            _apply_one(data, path, raw, model)
        except _OverrideProblem as exc:
            problems.append(Problem(exc.loc, exc.message, override=text))
            continue
        applied[path] = text
    return data, problems, applied


def _apply_one(data: dict[str, object], path: tuple[str, ...], raw: str, model: type[BaseModel]) -> None:
    """Walk schema and data together along `path`, creating missing mappings, and set the last key."""
    container = data
    section: type[BaseModel] | None = model  # None: we are inside a free-form map
    annotation: object = None
    for depth, key in enumerate(path):
        here = path[: depth + 1]
        if section is None:
            annotation = map_values(annotation)
        elif key in section.model_fields:
            annotation = section.model_fields[key].annotation
        else:
            raise _OverrideProblem(here, unknown_key_message(section, path[:depth], key))
        if depth == len(path) - 1:
            try:
                container[key] = coerce_value(raw, annotation)
            except YamlBoundError as exc:  # the same bounds as the file's own YAML
                raise _OverrideProblem(here, f"{exc.problem}; {exc.hint}") from None
            return
        section = section_model(annotation)
        if section is None and not is_map(annotation):
            raise _OverrideProblem(
                here, f"is {_kind(annotation)} and has no keys; set it whole: --override {dotted(here)}=…"
            )
        child = container.get(key)
        if child is None:
            child = container[key] = {}
        elif not isinstance(child, dict):
            raise _OverrideProblem(
                here, f"is {show_value(child)} in the YAML, not a mapping; set it whole: --override {dotted(here)}=…"
            )
        container = child


def coerce_value(raw: str, annotation: object) -> object:
    """Fit the text of an override to a field's type (see the module docstring)."""
    members = annotation_members(annotation)
    try:
        parsed = safe_load_bounded(raw) if raw.strip() else raw
    except YamlBoundError:
        raise
    except yaml.YAMLError:
        parsed = raw
    if annotation is Any or Any in members:
        return parsed
    if parsed is None and accepts_none(annotation):
        return None
    if any(_fits(parsed, member) for member in members if member is not str):
        return parsed
    if str in members:
        stripped = raw.strip()
        quoted = len(stripped) >= 2 and stripped[0] == stripped[-1] and stripped[0] in "'\""
        return parsed if quoted and isinstance(parsed, str) else raw
    return parsed  # the model reports the type error, blaming this override


def _fits(value: object, member: object) -> bool:
    if member is bool:
        return isinstance(value, bool)
    if member is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if member is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if member is list or get_origin(member) is list:
        return isinstance(value, list)
    if member is dict or get_origin(member) is dict:
        return isinstance(value, dict)
    if isinstance(member, type) and issubclass(member, BaseModel):
        return isinstance(value, dict)
    return False


def _kind(annotation: object) -> str:
    members = annotation_members(annotation)
    if any(m is list or get_origin(m) is list for m in members):
        return "a list"
    names = {str: "a string", int: "an integer", float: "a number", bool: "a boolean"}
    return next((names[m] for m in members if m in names), "a value")

