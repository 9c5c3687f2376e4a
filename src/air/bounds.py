"""Bounded input: YAML and JSON read within fixed budgets, so a small hostile document cannot take the
memory, the stack or the time of whoever reads it (issue 22).

A 471-byte YAML "billion laughs" (nine levels of nine-fold aliases) is 387 million values once expanded;
10,000 nested `[` overflow Python's stack; a 5,000-digit integer is a `ValueError` deep inside the parser.
Here each is refused while the document is composed, before any Python object is built, with the line it
is on: aliases may expand to at most `MAX_YAML_ALIAS_VALUES` values, nesting is at most `MAX_YAML_DEPTH`,
integers fit in 64 bits. JSON bodies of the server get the same depth and integer bounds.

The numeric limits of a workload (`max_retries`, timeouts, accelerators) live here too, so the YAML, the
API and the errors that name them agree.
"""

from __future__ import annotations

import json
from typing import Any, NoReturn, TypeAlias

import yaml

from air.errors import UserInputError

#: Nesting levels of a YAML document (a mapping in a list in a mapping… counts one per level).
MAX_YAML_DEPTH = 64
#: Values that aliases (`*name`) may add to a document once expanded, all aliases together.
MAX_YAML_ALIAS_VALUES = 100_000
#: Integers are signed 64-bit: what SQLite, JSON readers and every training framework can hold.
MIN_INT, MAX_INT = -(1 << 63), (1 << 63) - 1
#: Nesting levels of a JSON request body (a submitted spec's parameters nest inside it).
MAX_JSON_DEPTH = 100
#: A JSON request body larger than this is refused (413): a 100,000-file snapshot manifest fits.
MAX_JSON_BYTES = 32 << 20

#: Workload limits: beyond them a value is a typo, not a plan.
MAX_RETRIES = 100
MAX_TIMEOUT_MINUTES = 30 * 24 * 60
MAX_NUM_ACCELERATORS = 100_000
#: A secret's value (bytes of UTF-8) and how many secrets one user may keep on a server.
MAX_SECRET_BYTES = 64 << 10
MAX_SECRETS_PER_USER = 1000
#: Entries of a run's `permissions` (each a user or group and a level), in a workload or an API body.
MAX_PERMISSION_ENTRIES = 1000
#: Child runs one `for_each` sweep may expand to (items, or grid combinations).
MAX_SWEEP_ITEMS = 1000
#: A workload's `_bases_`: how deep bases may nest, and how many files one workload may read in all.
MAX_BASES_DEPTH = 8
MAX_BASE_FILES = 32
#: Integer query parameters of the API (limits, counts, attempts, nodes, ranks): they reach SQLite.
MAX_QUERY_INT = (1 << 31) - 1

#: A parsed JSON value (`json_loads_bounded`, a response body, a stored spec). For type checkers only: a
#: string at run time, so it never goes in a pydantic field or a FastAPI signature (use `object` there).
JSONValue: TypeAlias = "str | int | float | bool | None | list[JSONValue] | dict[str, JSONValue]"
#: A parsed JSON object.
JSONObject: TypeAlias = "dict[str, JSONValue]"


class YamlBoundError(yaml.MarkedYAMLError):
    """A YAML document past one of the bounds; `problem_mark` is where, `hint` what to do."""

    def __init__(self, problem: str, mark: yaml.Mark | None, hint: str) -> None:
        super().__init__(problem=problem, problem_mark=mark)
        self.hint = hint

    @property
    def line(self) -> int | None:
        return self.problem_mark.line + 1 if self.problem_mark is not None else None


class BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader that counts while composing: the depth of the open nodes, and the values each
    node stands for once its aliases are expanded (a node's size is known when it is closed, so an alias
    costs the size of what it names). A recursive alias (`&a [*a]`) is refused too."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._expanded = 0
        self._aliased = 0
        self._sizes: dict[int, int] = {}

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:  # Any: the stub says int,
        # PyYAML passes a key node for a mapping value
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            named = self.anchors.get(event.anchor)
            if named is not None:
                size = self._sizes.get(id(named))
                if size is None:
                    raise YamlBoundError(f"the alias *{event.anchor} is inside the value it names (a loop)",
                                         event.start_mark, "Write the value out instead of referring to itself.")
                self._aliased += size
                self._expanded += size
                if self._aliased > MAX_YAML_ALIAS_VALUES:
                    raise YamlBoundError(
                        f"aliases (*name) expand to more than {MAX_YAML_ALIAS_VALUES} values",
                        event.start_mark, "Write the values out, or keep large data in the code snapshot and "
                        "read it from there.")
            return super().compose_node(parent, index)
        self._depth += 1
        if self._depth > MAX_YAML_DEPTH:
            raise YamlBoundError(f"nested deeper than {MAX_YAML_DEPTH} levels", self.peek_event().start_mark,
                                 "Flatten the structure, or keep deep data in a file of the code snapshot.")
        start = self._expanded
        self._expanded += 1
        node = super().compose_node(parent, index)
        self._sizes[id(node)] = self._expanded - start
        self._depth -= 1
        return node

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        """Integers within 64 bits; the length is checked before Python converts the digits."""
        text = str(node.value).replace("_", "")
        value: int | None = None
        if len(text) <= 70:  # '-0b' and 64 binary digits; beyond it no 64-bit integer is written
            value = super().construct_yaml_int(node)
        if value is None or not MIN_INT <= value <= MAX_INT:
            shown = text if len(text) <= 30 else f"{text[:12]}…{text[-6:]} ({len(text)} characters)"
            raise YamlBoundError(f"the integer {shown} is out of range (at most 64 bits: {MIN_INT} to {MAX_INT})",
                                 node.start_mark, "Quote it to keep it as text, or write a smaller number.")
        return value


BoundedLoader.add_constructor("tag:yaml.org,2002:int", BoundedLoader.construct_yaml_int)


def compose_bounded(text: str) -> tuple[object, yaml.Node | None]:
    """One YAML document, within the bounds: its data and its node tree (for line numbers). Raises
    `YamlBoundError` past a bound, other `yaml.YAMLError`s for bad YAML."""
    loader = BoundedLoader(text)
    try:
        node = loader.get_single_node()
        return (loader.construct_document(node) if node is not None else None), node
    finally:
        loader.dispose()


def safe_load_bounded(text: str) -> object:
    """`yaml.safe_load` within the bounds (an --override value, a requirements YAML)."""
    return compose_bounded(text)[0]


# ---- JSON -------------------------------------------------------------------------------------------


def _json_int(text: str) -> int:
    digits = text.lstrip("-")
    if len(digits) > 19 or not MIN_INT <= int(text) <= MAX_INT:
        shown = text if len(text) <= 30 else f"{text[:12]}…{text[-6:]} ({len(text)} characters)"
        raise UserInputError(f"The request body holds the integer {shown}, out of range "
                             f"(at most 64 bits: {MIN_INT} to {MAX_INT}).", hint="Send a smaller number.")
    return int(text)


def _json_constant(name: str) -> NoReturn:
    raise UserInputError(f"The request body holds {name}, which is not a JSON number.",
                         hint="Send finite numbers only.")


def _json_depth(value: JSONValue) -> int:
    """How deep containers nest in `value` (without recursion), stopping early past MAX_JSON_DEPTH."""
    deepest = 0
    stack: list[tuple[JSONValue, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if deepest > MAX_JSON_DEPTH:
                break
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def json_loads_bounded(data: bytes) -> JSONValue:
    """A JSON request body, parsed within the bounds (depth, 64-bit integers, finite numbers); anything
    else is a `UserInputError` (400) that says what is wrong."""
    too_deep = UserInputError(f"The request body nests deeper than {MAX_JSON_DEPTH} levels.",
                              hint="Flatten the data you send.")
    try:
        value = json.loads(data or b"null", parse_int=_json_int, parse_constant=_json_constant)
    except RecursionError:  # the C parser's own guard, far below a real stack overflow
        raise too_deep from None
    except ValueError as exc:
        raise UserInputError(f"The request body is not JSON: {exc}.") from None
    if _json_depth(value) > MAX_JSON_DEPTH:
        raise too_deep
    return value

