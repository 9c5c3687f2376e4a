"""The workload's `for_each:` block: one run becomes a sweep of child runs, one per item.

`parameters:` is a grid (every combination of the listed values, in the order written: the last key
varies fastest); `items:` is an explicit list of parameter maps. Each item is merged over the workload's
own `parameters:` (a nested map merges key by key) and written to the child's HYPERPARAMETERS_PATH.
The number of items is bounded (`MAX_SWEEP_ITEMS`) before anything is expanded, so `a: [..100]` times
ten keys is refused at once, not after building 10^20 maps.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from air.bounds import MAX_SWEEP_ITEMS
from air.workload.spec_rules import fail


class ForEachSpec(BaseModel):
    """`for_each:` — exactly one of `parameters` (a grid) or `items` (a list), and `max_concurrent`."""

    model_config = ConfigDict(extra="forbid", strict=True)

    parameters: dict[str, list[Any]] | None = Field(
        None,
        description="A grid: NAME: [values]; one child run per combination of the values (the last name varies "
        f"fastest). At most {MAX_SWEEP_ITEMS} combinations.",
        examples=[{"lr": [0.001, 0.0001], "batch_size": [16, 32]}],
        json_schema_extra={"air_type": "map: NAME → list of values"},
    )
    items: list[dict[str, Any]] | None = Field(
        None,
        description="An explicit list of parameter maps; one child run per map. At most "
        f"{MAX_SWEEP_ITEMS} items.",
        examples=[[{"lr": 0.001, "model": "small"}, {"lr": 0.0001, "model": "large"}]],
        json_schema_extra={"air_type": "list of maps"},
    )
    max_concurrent: int | None = Field(
        None,
        ge=1,
        le=MAX_SWEEP_ITEMS,
        description="How many child runs may be active at once (queued or running); the rest start as others "
        "end. Unset: all at once (they still queue for accelerators).",
        examples=[2],
    )

    @field_validator("parameters")
    @classmethod
    def _grid(cls, value: dict[str, list[Any]] | None) -> dict[str, list[Any]] | None:
        if value is None:
            return None
        if not value:
            fail("must name at least one parameter with a list of values")
        for name, values in value.items():
            if not name.strip():
                fail("a parameter name must not be empty")
            if not values:
                fail("must list at least one value, got []", field=name)
        size = math.prod(len(v) for v in value.values())
        if size > MAX_SWEEP_ITEMS:
            fail(f"expands to {size} combinations, more than {MAX_SWEEP_ITEMS}; use fewer values or split the sweep")
        return value

    @field_validator("items")
    @classmethod
    def _items(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        if value is None:
            return None
        if not value:
            fail("must list at least one parameter map, got []")
        if len(value) > MAX_SWEEP_ITEMS:
            fail(f"has {len(value)} items, more than {MAX_SWEEP_ITEMS}; split the sweep")
        for index, item in enumerate(value):
            if not item:
                fail("is an empty map; give each item at least one parameter", field=str(index))
        return value

    @model_validator(mode="after")
    def _exactly_one(self) -> ForEachSpec:
        if (self.parameters is None) == (self.items is None):
            which = "both" if self.parameters is not None else "neither"
            fail(f"needs exactly one of parameters (a grid) or items (a list of maps); got {which}")
        return self

    def expand(self) -> list[dict[str, object]]:
        """Every item, in order: the grid's combinations, or the items as written."""
        if self.items is not None:
            return [dict(item) for item in self.items]
        grid = self.parameters or {}
        names = list(grid)
        return [dict(zip(names, combo, strict=True)) for combo in itertools.product(*grid.values())]


def merge_parameters(base: Mapping[str, object] | None, item: Mapping[str, object]) -> dict[str, object]:
    """`item` over `base`: a key of both whose values are both maps merges key by key; otherwise the item wins.
    `_bases_` merge the same way (a workload over its bases)."""
    merged = dict(base or {})
    for key, value in item.items():
        old = merged.get(key)
        if isinstance(old, Mapping) and isinstance(value, Mapping):
            merged[key] = merge_parameters(old, value)
        else:
            merged[key] = value
    return merged


def describe_item(item: Mapping[str, object], width: int = 60) -> str:
    """`lr=0.001, batch_size=16` for tables (cut to `width`)."""
    text = ", ".join(f"{k}={json.dumps(v, default=str) if isinstance(v, (dict, list)) else v}"
                     for k, v in item.items())
    return text if len(text) <= width else text[: width - 1] + "…"

