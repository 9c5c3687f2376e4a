"""Reading a workload: `load_workload` (a YAML file) and `parse_workload` (data in memory) apply the
overrides, resolve paths and validate against the model (spec.py), and report every problem at once.

A bad file gets *every* problem in one error, each as `FILE: field.path: what is wrong (line N)`, with
"did you mean" for unknown keys and a specific hint for keys the hosted product renamed or that only make
sense there. Relative paths resolve against the YAML file's folder, so `air run -f path/to/train.yaml`
works from any directory.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import ValidationError

from air.bounds import MAX_BASE_FILES, MAX_BASES_DEPTH, MAX_YAML_DEPTH, YamlBoundError, compose_bounded
from air.errors import UserInputError
from air.workload.overrides import apply_overrides
from air.workload.schema import model_at, unknown_key_message
from air.workload.spec import WorkloadSpec
from air.workload.spec_rules import MAX_YAML_BYTES, Problem, dotted, show_value
from air.workload.sweep_spec import merge_parameters as deep_merge

# ---- problems and the error that lists them ---------------------------------------------------------


class WorkloadSpecError(UserInputError):
    """A workload YAML (or its overrides) that does not validate; `problems` lists every one of them."""

    def __init__(self, source: str, problems: Sequence[Problem], *, hint: str | None = None) -> None:
        self.source = source
        self.problems = list(problems)
        super().__init__("\n".join(p.render(source) for p in self.problems), hint=hint)


#: Where a key was written: its line, and the base file (`_bases_`) it is in (None: the workload file).
Where = tuple[int, str | None]


def _problems_from(exc: ValidationError, lines: Mapping[tuple[str, ...], Where]) -> list[Problem]:
    """Turn pydantic's errors into our problems: paths cleaned up, messages in the user's words."""
    problems: list[Problem] = []
    for err in exc.errors(include_url=False):
        # pydantic's validator tags ("function-after[...]") leave the path; an unknown or missing key is
        # the user's own last part, whatever it holds (a key "a[b" is not a tag: no IndexError, a 400)
        raw = tuple(err["loc"])
        key = raw[-1:] if err["type"] in ("extra_forbidden", "missing") else ()
        loc = tuple(s for s in raw[:len(raw) - len(key)] if not (isinstance(s, str) and "[" in s)) + key
        ctx = err.get("ctx") or {}
        if ctx.get("air_field"):
            loc = (*loc, ctx["air_field"])
        message = _describe(err, loc)
        if "[key]" in err["loc"]:  # the name of a map entry is wrong, not its value
            message = f"the key {message}"
        line, file = _line_of(loc, lines) or (None, None)
        problems.append(Problem(loc, message, line=line, file=file))
    return problems


def _describe(err: Mapping[str, object], loc: tuple[str | int, ...]) -> str:
    kind, value = err["type"], err.get("input")
    if kind == "air_invalid":
        return str(err["msg"])
    if kind == "extra_forbidden":
        parent = model_at(loc[:-1])
        return unknown_key_message(parent, loc[:-1], loc[-1]) if parent else "unknown key"
    if kind == "missing":
        return _missing_message(loc)
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        topic = ".".join(str(s) for s in loc)
        return f"must be a mapping of keys (see `air -h config.{topic}`), got {show_value(value)}"
    message = str(err["msg"]).replace("Input should be", "must be").replace("a valid integer", "an integer")
    message = message.replace("a valid ", "a ")
    if kind in ("string_type", "int_type", "float_type", "list_type", "bool_type", "literal_error",
                "greater_than", "greater_than_equal", "less_than_equal", "int_from_float"):
        message += f", got {show_value(value)}"
    return message


def _missing_message(loc: tuple[str | int, ...]) -> str:
    parent = model_at(loc[:-1])
    field = parent.model_fields.get(str(loc[-1])) if parent else None
    message = "required field is missing"
    example = field.examples[0] if field is not None and field.examples else None
    if example is not None and not (isinstance(example, str) and "\n" in example):
        flow = yaml.safe_dump(example, default_flow_style=True, sort_keys=False, width=200).strip().removesuffix("...").strip()
        message += f", e.g. {loc[-1]}: {flow}"
    return message


def _line_of(loc: Sequence[str | int], lines: Mapping[tuple[str, ...], Where]) -> Where | None:
    key = tuple(str(s) for s in loc)
    for end in range(len(key), 0, -1):
        if key[:end] in lines:
            return lines[key[:end]]
    return None


def _hint_for(problems: Sequence[Problem]) -> str:
    """Point at the help page of the first problem's section (or field, at the top level)."""
    topic = "config"
    first = next((p.loc for p in problems if p.loc), ())
    if first and first[0] in WorkloadSpec.model_fields:
        depth = max(k for k in range(1, len(first) + 1) if k == 1 or model_at(first[:k]) is not None)
        topic = f"config.{dotted(first[:depth])}"
    return f"See `air -h {topic}` for what each field takes."


# ---- reading YAML -----------------------------------------------------------------------------------


def _read_yaml(path: Path, shown: str) -> tuple[dict[str, object], dict[tuple[str, ...], int], list[Problem]]:
    """Parse the file: its data, the line of every key, and duplicate keys (which YAML would hide)."""
    if path.suffix.lower() not in (".yaml", ".yml"):
        raise UserInputError(
            f"{shown}: a workload file must end in .yaml or .yml",
            hint="Pass the workload YAML, e.g. `air run -f train.yaml`.",
        )
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise UserInputError(f"{shown}: no such file", hint="Check the path of the workload YAML.") from None
    except IsADirectoryError:
        raise UserInputError(f"{shown}: is a folder, not a YAML file") from None
    except OSError as exc:
        raise UserInputError(f"{shown}: cannot be read ({exc.strerror or exc})") from None
    if len(raw) > MAX_YAML_BYTES:
        raise UserInputError(
            f"{shown}: the file is {len(raw)} bytes; a workload YAML must be under {MAX_YAML_BYTES} bytes",
            hint="Keep data in the code snapshot (code_source), not in parameters.",
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserInputError(f"{shown}: is not UTF-8 text (byte {exc.start})") from None

    try:
        data, node = compose_bounded(text)
    except YamlBoundError as exc:
        raise UserInputError(f"{shown}: line {exc.line}: {exc.problem}", hint=exc.hint) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        what = exc.problem or "syntax error"
        if exc.context and exc.context_mark and exc.context_mark is not mark:
            what += f" ({exc.context} at line {exc.context_mark.line + 1})"
        elif exc.context:
            what += f" ({exc.context})"
        if isinstance(exc, yaml.constructor.ConstructorError):
            hint = "A workload is plain YAML: tags such as !!python/… are not allowed."
        elif exc.context and "single document" in exc.context:
            what, hint = "the file holds more than one YAML document ('---')", "A workload is one document."
        else:
            hint = "Check the indentation (spaces, not tabs) and the quotes around that line."
        raise UserInputError(f"{shown}: invalid YAML{where}: {what}", hint=hint) from None
    except yaml.YAMLError as exc:
        raise UserInputError(f"{shown}: invalid YAML: {exc}") from None

    if data is None:
        raise UserInputError(
            f"{shown}: the file is empty; a workload needs at least experiment_name, compute and command",
            hint="See `air -h config` for an example.",
        )
    if not isinstance(data, dict):
        raise UserInputError(
            f"{shown}: the top level must be a mapping of fields (experiment_name: …, compute: …, command: …), "
            f"got {show_value(data)}",
            hint="See `air -h config` for an example.",
        )
    assert node is not None  # data came from it
    lines: dict[tuple[str, ...], int] = {}
    problems: list[Problem] = []
    _index_lines(node, (), lines, problems, depth=0, walked=set())
    return data, lines, problems


def _index_lines(
    node: yaml.Node, loc: tuple[str, ...], lines: dict[tuple[str, ...], int], problems: list[Problem], depth: int,
    walked: set[int],
) -> None:
    """The line of every key, each node walked once: what an alias names was indexed where it was written
    (a problem under the alias is reported at the alias's own line), so aliases cost nothing here."""
    if depth > MAX_YAML_DEPTH or id(node) in walked:
        return
    walked.add(id(node))
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key, line = key_node.value, key_node.start_mark.line + 1
            here = (*loc, key)
            if key in seen:
                problems.append(
                    Problem(here, f"duplicate key (first at line {seen[key]}); YAML keeps only the last", line=line)
                )
            seen[key] = line
            lines[here] = line
            _index_lines(value_node, here, lines, problems, depth + 1, walked)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            here = (*loc, str(index))
            lines[here] = item.start_mark.line + 1
            _index_lines(item, here, lines, problems, depth + 1, walked)


# ---- paths ------------------------------------------------------------------------------------------


def _expand(text: str, base_dir: Path) -> tuple[Path | None, str | None]:
    """`~`, $VAR and `project_root/` expanded, relative paths joined to base_dir; or why it failed."""
    if text.startswith("project_root/"):
        text = text[len("project_root/"):] or "."
    expanded = os.path.expanduser(os.path.expandvars(text))
    unset = re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", expanded)
    if unset:
        return None, f"environment variable ${unset[0]} is not set (in {text!r})"
    path = Path(expanded)
    if not path.is_absolute():
        path = base_dir / path
    return Path(os.path.normpath(path)), None


def _resolve_paths(data: dict[str, object], base_dir: Path) -> list[Problem]:
    """Make the file's paths absolute (in place) and check they exist; type errors are left to the model."""
    code_source = data.get("code_source")
    snapshot = code_source.get("snapshot") if isinstance(code_source, dict) else None
    environment = data.get("environment")
    problems: list[Problem] = []
    if isinstance(snapshot, dict):
        problems += _resolve_snapshot(snapshot, base_dir)
    if isinstance(environment, dict):
        problems += _resolve_dependencies(environment, base_dir)
    return problems


def _resolve_snapshot(snapshot: dict[str, object], base_dir: Path) -> list[Problem]:
    loc = ("code_source", "snapshot", "root_path")
    given = snapshot.get("root_path")
    if not isinstance(given, str) or not given.strip():
        return []
    root, why = _expand(given.strip(), base_dir)
    if root is None:
        return [Problem(loc, str(why))]
    if not root.exists():
        return [Problem(loc, f"folder {root} does not exist (from {given.strip()!r}, relative to {base_dir})")]
    if not root.is_dir():
        return [Problem(loc, f"{root} is not a folder")]
    snapshot["root_path"] = str(root)
    includes = snapshot.get("include_paths")
    if snapshot.get("git") is not None or not isinstance(includes, list):
        return []  # a pinned commit's tree is checked by the snapshot, not the working tree
    problems = []
    for index, item in enumerate(includes):
        if not isinstance(item, str) or not item.strip() or os.path.isabs(item.strip()):
            continue  # the model says what is wrong with it
        if ".." not in item.replace("\\", "/").split("/") and not (root / item.strip()).exists():
            problems.append(Problem(("code_source", "snapshot", "include_paths", index),
                                    f"{item.strip()!r} does not exist in {root}"))
    return problems


def _resolve_dependencies(environment: dict[str, object], base_dir: Path) -> list[Problem]:
    loc = ("environment", "dependencies")
    deps = environment.get("dependencies")
    if not isinstance(deps, str) or not deps.strip():
        return []
    path, why = _expand(deps.strip(), base_dir)
    if path is None:
        return [Problem(loc, str(why))]
    if not path.is_file():
        state = "is not a file" if path.exists() else "does not exist"
        return [Problem(loc, f"requirements file {path} {state} (from {deps.strip()!r}, relative to {base_dir}); "
                             "give a list of requirements or a file path")]
    environment["dependencies"] = str(path)
    return []


# ---- _bases_: composing a workload from base files ------------------------------------------------


@dataclass
class Composed:
    """A workload file with its `_bases_` merged in: the data, where each key was written, the problems
    found while reading (duplicate keys), and the base files in the order they were merged."""

    data: dict[str, object]
    lines: dict[tuple[str, ...], Where]
    problems: list[Problem]
    bases: list[Path]


@dataclass
class _Budget:
    """What composing one workload may read, all files together (the YAML may come from anyone)."""

    files: int = 0
    bytes: int = 0


def compose_workload(path: Path, shown: str) -> Composed:
    """Read a workload file and merge its `_bases_` (recursively): bases in order, each later one and then
    the file itself winning over earlier ones. Mappings merge key by key; anything else (a list, a string,
    null) replaces what a base had. Relative paths in a base resolve against that base's folder.

    Raises `UserInputError` for a cycle (naming it), a missing or unreadable base, or a composition past
    the bounds (MAX_BASES_DEPTH levels, MAX_BASE_FILES files, MAX_YAML_BYTES in all)."""
    return _compose(path, shown, chain=(), budget=_Budget())


def _compose(path: Path, shown: str, *, chain: tuple[Path, ...], budget: _Budget) -> Composed:
    data, raw_lines, problems = _read_yaml(path, shown)
    budget.files += 1
    budget.bytes += path.stat().st_size
    if budget.bytes > MAX_YAML_BYTES:
        raise UserInputError(
            f"{shown}: the workload and its _bases_ are {budget.bytes} bytes together, more than {MAX_YAML_BYTES}",
            hint="Keep data in the code snapshot (code_source), not in the workload's files.",
        )
    own = None if not chain else _short(path, chain[0].parent)
    lines: dict[tuple[str, ...], Where] = {k: (v, own) for k, v in raw_lines.items()}
    problems = [Problem(p.loc, p.message, p.line, p.override, own) for p in problems]
    chain = (*chain, path)
    if "_bases_" not in data:
        return Composed(data, lines, problems, [])
    listed = data.pop("_bases_")
    line = raw_lines.get(("_bases_",))
    where = f" (line {line})" if line else ""
    if not isinstance(listed, list) or not all(isinstance(b, str) and b.strip() for b in listed):
        raise UserInputError(
            f"{shown}: _bases_ must be a list of YAML file paths, got {show_value(listed)}{where}",
            hint="e.g. _bases_: [base.yaml, ../shared/gpu.yaml] (relative to this file's folder)",
        )
    if len(chain) > MAX_BASES_DEPTH:
        raise UserInputError(
            f"{shown}: _bases_ nest deeper than {MAX_BASES_DEPTH} levels: "
            + " -> ".join(_short(p, chain[0].parent) for p in chain),
            hint="Flatten the bases: a base may list several bases of its own.",
        )
    merged: dict[str, object] = {}
    merged_lines: dict[tuple[str, ...], Where] = {}
    bases: list[Path] = []
    for index, given in enumerate(listed):
        base, why = _expand(given.strip(), path.parent)
        if base is None:
            raise UserInputError(f"{shown}: _bases_[{index}]: {why}{where}")
        if base in chain:
            cycle = [*chain[chain.index(base):], base]
            raise UserInputError(
                f"{shown}: _bases_ form a cycle: " + " -> ".join(_short(p, chain[0].parent) for p in cycle),
                hint="A file cannot be its own base; remove one of these _bases_ entries.",
            )
        if not base.is_file():
            state = "is not a file" if base.exists() else "does not exist"
            raise UserInputError(
                f"{shown}: _bases_[{index}]: base file {base} {state} (from {given.strip()!r}, relative to "
                f"{path.parent}){where}",
                hint="Base paths are relative to the folder of the file that lists them.",
            )
        if budget.files >= MAX_BASE_FILES:
            raise UserInputError(
                f"{shown}: the workload's _bases_ name more than {MAX_BASE_FILES} files in all",
                hint="Merge some of the bases into one file.",
            )
        part = _compose(base, _short(base, chain[0].parent), chain=chain, budget=budget)
        _rebase_paths(part.data, base.parent)
        merged = deep_merge(merged, part.data)
        merged_lines.update(part.lines)
        problems += part.problems
        bases += [*part.bases, base]
    merged_lines.update(lines)
    return Composed(deep_merge(merged, data), merged_lines, problems, bases)


def _rebase_paths(data: dict[str, object], folder: Path) -> None:
    """A base's relative paths (root_path, a requirements file) made absolute against its own folder, so
    they mean the same wherever it is included; what cannot be expanded is left for the checks."""
    code_source = data.get("code_source")
    snapshot = code_source.get("snapshot") if isinstance(code_source, dict) else None
    environment = data.get("environment")
    for block, key in ((snapshot, "root_path"), (environment, "dependencies")):
        if isinstance(block, dict) and isinstance(block.get(key), str) and block[key].strip():
            path, _ = _expand(block[key].strip(), folder)
            if path is not None:
                block[key] = str(path)


def _short(path: Path, folder: Path) -> str:
    """A file as messages name it: relative to the workload's folder when inside it."""
    try:
        return str(path.relative_to(folder))
    except ValueError:
        return str(path)


# ---- entry points -----------------------------------------------------------------------------------


def parse_workload(
    data: Mapping[str, object],
    *,
    source: str = "workload",
    base_dir: str | Path | None = None,
    overrides: Sequence[str] = (),
) -> WorkloadSpec:
    """Validate workload data already in memory (a stored spec, a generated one); `source` names it in
    messages, and relative paths resolve against base_dir (default: the working directory)."""
    base = Path(os.path.abspath(base_dir if base_dir is not None else os.getcwd()))
    if "_bases_" in data:
        raise UserInputError(
            f"{source}: _bases_ names files, and this workload came without them: bases are merged where the "
            "YAML file is read",
            hint="Submit with `air run -f FILE` (it merges the bases, here or before sending to an air server), "
                 "or send the merged workload (`air run -f FILE --dry-run` shows it).",
        )
    return _validate(data, source, base, overrides, lines={}, problems=[])


def load_workload(path: str | Path, overrides: Sequence[str] = ()) -> WorkloadSpec:
    """Read, override, resolve and validate a workload YAML; every problem is reported at once.

    Raises `UserInputError` (a `WorkloadSpecError` when the file parses but does not validate) whose
    message names the file and each field path.
    """
    shown = str(path)
    source = Path(os.path.abspath(os.path.expanduser(shown)))
    composed = compose_workload(source, shown)
    spec = _validate(composed.data, shown, source.parent, overrides, lines=composed.lines,
                     problems=composed.problems)
    spec._source_path = source
    spec._bases = tuple(composed.bases)
    return spec


def _validate(
    data: Mapping[str, object],
    source: str,
    base_dir: Path,
    overrides: Sequence[str],
    *,
    lines: Mapping[tuple[str, ...], Where],
    problems: list[Problem],
) -> WorkloadSpec:
    """Overrides, then paths, then the model; all their problems in one error, in file order."""
    data, override_problems, overridden = apply_overrides(copy.deepcopy(dict(data)), overrides)
    problems = [*problems, *_resolve_paths(data, base_dir), *override_problems]
    spec: WorkloadSpec | None = None
    try:
        spec = WorkloadSpec.model_validate(data)
    except ValidationError as exc:
        problems += _problems_from(exc, lines)
    if problems or spec is None:
        problems = [_mark_override(p, overridden) for p in _dedupe(problems)]
        problems.sort(key=lambda p: (p.line is None, p.file is not None, p.file or "", p.line or 0))
        raise WorkloadSpecError(source, problems, hint=_hint_for(problems))
    spec._source_dir = base_dir
    return spec


def _mark_override(problem: Problem, overridden: Mapping[tuple[str, ...], str]) -> Problem:
    """Blame the --override that set a field, not the YAML line it replaced."""
    if problem.override:
        return problem
    key = tuple(str(s) for s in problem.loc)
    for path, text in overridden.items():
        if key[: len(path)] == path:
            return Problem(problem.loc, problem.message, None, text)
    return problem


def _dedupe(problems: Sequence[Problem]) -> list[Problem]:
    seen: set[tuple[object, ...]] = set()
    out = []
    for problem in problems:
        key = (problem.loc, problem.message)
        if key not in seen:
            seen.add(key)
            out.append(problem)
    return out

