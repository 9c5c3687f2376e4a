"""`air -h config[.section[.field]]`: help for the workload YAML, generated from the spec model itself.

Field names, types, required/default, descriptions and examples all come from `WorkloadSpec`, so the help
cannot drift from what `load_workload` accepts. An unknown topic gets the same "did you mean" as an
unknown key in a YAML file.
"""

from __future__ import annotations

import textwrap
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from air.errors import UserInputError
from air.workload.schema import annotation_members, is_map, section_model, unknown_key_message
from air.workload.spec import WorkloadSpec
from air.workload.spec_rules import dotted

WIDTH = 100
_INDENT = "      "

EXAMPLE = """\
experiment_name: ddp-cpu-demo
compute:
  num_accelerators: 4          # 2 nodes of 2
  accelerator_type: CPU_2xCPU  # GPU_8xH100 on real hardware
environment:
  dependencies: [torch]
code_source:
  type: snapshot
  snapshot:
    root_path: .               # relative to this file
command: |
  cd $CODE_SOURCE_PATH
  torchrun --nnodes=$NUM_NODES --node_rank=$NODE_RANK \\
           --master_addr=$MASTER_ADDR --master_port=$MASTER_PORT \\
           --nproc_per_node=$LOCAL_WORLD_SIZE train.py
max_retries: 1
timeout_minutes: 60
hang_timeout_minutes: 15       # no output, heartbeat or report for 15 min: stacks saved, attempt retried
env_variables:
  TOKENIZERS_PARALLELISM: "false"
parameters:
  lr: 0.001
  epochs: 3
"""

_INTRO = (
    "A workload is one YAML file, started with `air run -f FILE`. Unknown keys are an error (with a \"did "
    "you mean\"), and relative paths resolve against the YAML file's folder. `air run --override "
    "KEY.PATH=VALUE` (repeatable) wins over the file; values are read as YAML and fitted to the field's "
    "type: compute.num_accelerators=16, env_variables.NAME=value, parameters.lr=0.001."
)


def config_help(path: str | None = None) -> str:
    """Help text for `air -h config` (path None or "config") or one section or field ("config.compute")."""
    loc = _topic(path)
    model: type[BaseModel] | None = WorkloadSpec
    field: FieldInfo | None = None
    for depth, key in enumerate(loc):
        here = loc[:depth]
        if model is None:
            assert field is not None
            what = "takes any key" if is_map(field.annotation) else "has no fields"
            raise UserInputError(
                f"no help for 'config.{dotted(loc)}': config.{dotted(here)} {what}",
                hint=f"See `air -h config.{dotted(here)}`.",
            )
        if key not in model.model_fields:
            raise UserInputError(
                f"no help for 'config.{dotted(loc)}': {unknown_key_message(model, here, key)}",
                hint="Topics: " + ", ".join(f"config.{t}" if t else "config" for t in topics()),
            )
        field = model.model_fields[key]
        model = section_model(field.annotation)
    if not loc:
        return _overview()
    assert field is not None
    return _topic_help(loc, field, model)


def topics() -> list[str]:
    """Every section path that has its own help page ('' is the overview)."""
    out = [""]

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            child = section_model(field.annotation)
            if child is not None:
                out.append(f"{prefix}{name}")
                walk(child, f"{prefix}{name}.")

    walk(WorkloadSpec, "")
    return out


def type_label(field: FieldInfo) -> str:
    """A field's type in words: 'integer', 'list of strings', 'section', 'map: NAME → string'."""
    extra = field.json_schema_extra
    label = extra.get("air_type") if isinstance(extra, dict) else None
    if isinstance(label, str):
        return label
    return _label(field.annotation)


def _label(annotation: object) -> str:
    members = annotation_members(annotation)
    if int in members and float in members:
        members = tuple(m for m in members if m is not int)
    labels: list[str] = []
    for member in members:
        label = _member_label(member)
        if label not in labels:
            labels.append(label)
    return " or ".join(labels) or "any value"


def _member_label(member: object) -> str:
    names = {str: "string", int: "integer", float: "number", bool: "boolean"}
    if member in names:
        return names[member]
    origin = get_origin(member)
    if origin is list:
        (item,) = get_args(member) or (Any,)
        return f"list of {_label(item)}s"
    if origin is dict:
        key, value = get_args(member) or (Any, Any)
        if value is Any:
            return "map (any keys, any nesting)"
        return f"map: {_label(key)} → {_label(value)}"
    if origin is Literal:
        return " or ".join(repr(arg) for arg in get_args(member))
    if isinstance(member, type) and issubclass(member, BaseModel):
        return "section"
    return "any value"


def presence(field: FieldInfo) -> str:
    """'required', 'optional', or 'default: 3'."""
    if field.is_required():
        return "required"
    if field.default_factory is not None or field.default is None:
        return "optional"
    return f"default: {field.default}"


# ---- rendering --------------------------------------------------------------------------------------


def _overview() -> str:
    parts = [
        "air -h config: the workload YAML",
        "",
        textwrap.fill(_INTRO, WIDTH),
        "",
        "Fields:",
        _field_list(WorkloadSpec, ()),
        "Example:",
        textwrap.indent(EXAMPLE, "  ").rstrip(),
        "",
        "More: " + ", ".join(f"air -h config.{t}" for t in topics() if t),
        "Any field: air -h config.<path>, e.g. air -h config.compute.num_accelerators",
    ]
    return "\n".join(parts) + "\n"


def _topic_help(loc: tuple[str, ...], field: FieldInfo, model: type[BaseModel] | None) -> str:
    path = dotted(loc)
    parts = [f"config.{path}: {type_label(field)}, {presence(field)}", ""]
    if field.description:
        parts += [textwrap.fill(field.description, WIDTH), ""]
    if model is not None:
        parts += ["Fields:", _field_list(model, loc)]
    if field.examples:
        parts += ["Example:", textwrap.indent(_example_yaml(loc, field.examples[0]), "  ").rstrip(), ""]
    override_example = _override_example(loc, field, model)
    if override_example:
        parts.append(f"From the command line: air run -f FILE --override {override_example}")
    if model is not None:
        subtopics = [t for t in topics() if t.startswith(f"{path}.") and t.count(".") == path.count(".") + 1]
        if subtopics:
            parts.append("More: " + ", ".join(f"air -h config.{t}" for t in subtopics))
    return "\n".join(parts).rstrip() + "\n"


def _field_list(model: type[BaseModel], loc: tuple[str, ...]) -> str:
    width = max(len(name) for name in model.model_fields) + 2
    rows: list[str] = []
    for name, field in model.model_fields.items():
        head = f"  {name.ljust(width)}{type_label(field)}, {presence(field)}"
        if section_model(field.annotation) is not None:
            head += f"  (air -h config.{dotted((*loc, name))})"
        rows.append(head)
        if field.description:
            rows.append(textwrap.fill(field.description, WIDTH, initial_indent=_INDENT, subsequent_indent=_INDENT))
    return "\n".join(rows) + "\n"


class _HelpDumper(yaml.SafeDumper):
    """Multi-line strings (the command) as `|` blocks, as users write them."""


def _str_presenter(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_HelpDumper.add_representer(str, _str_presenter)


def _example_yaml(loc: tuple[str, ...], example: object) -> str:
    data: object = example
    for key in reversed(loc):
        data = {key: data}
    return yaml.dump(data, Dumper=_HelpDumper, sort_keys=False, default_flow_style=False, width=WIDTH)


def _override_example(loc: tuple[str, ...], field: FieldInfo, model: type[BaseModel] | None) -> str | None:
    """A realistic `--override` for the topic: the first field of a section, or the field itself."""
    if model is not None:
        for name, child in model.model_fields.items():
            if get_origin(child.annotation) is Literal:
                continue
            found = _override_example((*loc, name), child, section_model(child.annotation))
            if found:
                return found
        return None
    if not field.examples:
        return None
    example = field.examples[0]
    if isinstance(example, dict):
        key, value = next(iter(example.items()))
        if isinstance(value, dict):
            return None
        return f"{dotted(loc)}.{key}={_flow(value)}"
    if isinstance(example, str) and "\n" in example:
        return None
    return f"{dotted(loc)}={_flow(example)}"


def _flow(value: object) -> str:
    if isinstance(value, str):
        return value if " " not in value else repr(value)
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("...").strip()


def _topic(path: str | None) -> tuple[str, ...]:
    """'config.compute' (or 'compute') → ('compute',); None, '' and 'config' → ()."""
    text = (path or "").strip()
    if text in ("", "config"):
        return ()
    if text.startswith("config."):
        text = text[len("config."):]
    parts = tuple(text.split("."))
    if any(not part for part in parts):
        raise UserInputError(f"no help for {path!r}: expected a dotted path like config.compute")
    return parts

