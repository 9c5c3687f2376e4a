"""Schema navigation over the workload model: which section a field path is, what a field accepts,
and why a key is unknown. Shared by loading.py (messages), overrides.py and config_help.py.
"""

from __future__ import annotations

import difflib
import types
from collections.abc import Sequence
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel

from air.workload.spec import WorkloadSpec
from air.workload.spec_rules import HOSTED_ONLY_KEYS, RENAMED_KEYS, dotted


def annotation_members(annotation: object) -> tuple[object, ...]:
    """The member types of an annotation, without Annotated wrappers and without None."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return annotation_members(get_args(annotation)[0])
    if origin is Union or origin is types.UnionType:
        return tuple(m for arg in get_args(annotation) for m in annotation_members(arg))
    if annotation is type(None):
        return ()
    return (annotation,)


def accepts_none(annotation: object) -> bool:
    """Whether a field may be set to null (`str | None`, Any), as opposed to `str`."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return accepts_none(get_args(annotation)[0])
    if origin is Union or origin is types.UnionType:
        return any(accepts_none(arg) for arg in get_args(annotation))
    return annotation is type(None) or annotation is Any


def section_model(annotation: object) -> type[BaseModel] | None:
    """The section model an annotation holds (ComputeSpec for `compute`), or None for other fields."""
    for member in annotation_members(annotation):
        if isinstance(member, type) and issubclass(member, BaseModel):
            return member
    return None


_NOT_A_MAP = object()


def map_values(annotation: object) -> object:
    """The value type of a free-form map field (Any for parameters, str for env_variables), else _NOT_A_MAP."""
    if annotation is Any:
        return Any
    for member in annotation_members(annotation):
        if member is Any:
            return Any
        if get_origin(member) is dict:
            return get_args(member)[1]
    return _NOT_A_MAP


def is_map(annotation: object) -> bool:
    return map_values(annotation) is not _NOT_A_MAP


def model_at(loc: Sequence[str | int], root: type[BaseModel] | None = None) -> type[BaseModel] | None:
    """The section model at a field path (ComputeSpec at ('compute',)), or None if it is no section."""
    model: type[BaseModel] | None = root or WorkloadSpec
    for seg in loc:
        if model is None or not isinstance(seg, str) or seg not in model.model_fields:
            return None
        model = section_model(model.model_fields[seg].annotation)
    return model


def unknown_key_message(model: type[BaseModel], parent: Sequence[str | int], key: str | int) -> str:
    """Why `key` is not allowed under `parent`: a rename hint, a "did you mean", and the valid keys."""
    full = ".".join(str(s) for s in (*parent, key))
    if full in RENAMED_KEYS:
        return f"unknown key: {RENAMED_KEYS[full]}"
    if full in HOSTED_ONLY_KEYS:
        return f"unknown key: {HOSTED_ONLY_KEYS[full]}"
    names = list(model.model_fields)
    message = "unknown key"
    lowered = {name.lower(): name for name in names}
    close = (
        [lowered[str(key).lower()]] if str(key).lower() in lowered
        else difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
    )
    if close:
        message += f"; did you mean {close[0]!r}?"
    here = f"under {dotted(parent)}" if parent else "at the top level"
    return f"{message} (valid keys {here}: {', '.join(names)})"
