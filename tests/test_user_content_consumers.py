"""Every place air consumes what a user sent is known, and docs/access.md says where each one runs.

The rule (docs/access.md, "Where user content is consumed"): the server's account handles only typed,
bounded data; every byte a user supplied is parsed, built, imported or unpickled inside that user's
sandbox, as that user. This test holds the rule's table to the code: an AST scan of air's modules (all of
src/air but the client's side, air.cli and air.client, which run as the user on their own machine)
finds the consumers below, and fails when one appears that CONSUMERS does not list (a new door: say in
docs/access.md where it runs and add it here), when one listed is gone, and when the docs' table and
CONSUMERS disagree (each row of the docs names the functions of its row, `module:function`).

What the scan calls a consumer (`kind`):
- unpickle: pickle/cloudpickle/dill/marshal `load`/`loads`/`Unpickler`, `torch.load`;
- install: an argv literal that names uv or pip (`[uv, "pip", "install", ...]`, `[python, "-m", "pip"]`);
- import: `importlib.import_module`, `__import__`, `runpy.run_*`, `exec`, `eval`;
- yaml: a YAML load (PyYAML's, air.bounds' bounded one; air.bounds itself is the bound, not scanned);
- json: a JSON parse in the HTTP-facing modules (air.server, air.web): request and MLflow bodies; and in
  the modules that parse what a run's own processes write (RUN_OUTPUT_MODULES);
- graphql: a GraphQL document parsed (graphql-core's `parse`);
- unpack: an archive unpacked (`extractall`, `shutil.unpack_archive`);
- read: `open()`, `Path.open/read_text/read_bytes` of a path built from user input, where the scan can
  tell: the path expression names a parameter or local that carries one (USER_NAMES, and the locals
  assigned from them in the same function), or any read in a module whose paths are all a user's
  (USER_PATH_MODULES).
`exec`/`eval` of a constant (air's own source text) is not a consumer.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "air"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "access.md"
#: The client's side: runs as the user, on their machine, over their own files. air.bounds: the bounded
#: parsers themselves (their callers are the consumers).
CLIENT_SIDE = ("cli", "client")
NOT_SCANNED = ("air.bounds",)
#: Modules every path of which a user named (requirement files and local packages of `dependencies`).
USER_PATH_MODULES = ("air.environments.dependencies",)

#: Names that carry user input in air's code (a request or its body, a spec, a snapshot's entry, a
#: dependency line, a blob's name...): a path built from one of them is a user-named path.
USER_NAMES = frozenset({
    "request", "body", "spec", "spec_data", "manifest", "entry", "entries", "files", "text", "line", "lines",
    "value", "display", "requirement", "requirements", "dependencies", "deps", "digest", "target", "label",
    "root_path", "payload", "parameters", "hyperparameters", "url", "source",
})

_PICKLERS = {"pickle", "cloudpickle", "dill", "marshal", "_pickle"}
_YAML_LOADS = {"safe_load", "load", "full_load", "unsafe_load", "load_all", "safe_load_all", "full_load_all",
               "unsafe_load_all", "compose", "compose_all"}
_AIR_YAML = {"safe_load_bounded", "compose_bounded"}
_JSON_LOADS = {("json", "loads"), ("json", "load"), ("orjson", "loads"), ("ujson", "loads")}
_AIR_JSON = {"json_loads_bounded", "model_validate_json", "validate_json"}
_INSTALLER_WORDS = {"pip", "venv", "sync", "install"}
_HTTP_FACING = ("server", "web")
#: Modules that parse files a run's processes write (outcome headers, torch's error files).
RUN_OUTPUT_MODULES = ("air.distributed.outcome", "air.runs.reasons")

# The rows of docs/access.md's table (its first column).
YAML = "Workload YAML"
BODIES = "API bodies"
CODE = "Code: the snapshot, the command, modules to run or preload"
REQUIREMENTS = "Requirement files and dependencies"
BUILDS = "Dependency builds (uv, PEP 517 backends, setup.py)"
CALL = "Pickled call (the function and its arguments)"
OUTCOMES = "Call outcomes (return values, exceptions)"
MLFLOW = "MLflow bodies through the door (REST, ajax-api, GraphQL, artifacts)"
PARAMETERS = "Parameters and hyperparameters"
CONFIG = "The server's config.yaml"
RAY = "Snapshots on a Ray cluster"
SLURM = "Node plans on a Slurm cluster"
ERROR_FILES = "Root causes a process records (TORCHELASTIC_ERROR_FILE)"

#: (kind, "module:function") -> the title of docs/access.md's row it belongs to. Keep the two in step.
CONSUMERS: dict[tuple[str, str], str] = {
    # the user's own process (air run -f, --override); the server's re-reads of the spec air dumped itself
    ("yaml", "air.workload.loading:_read_yaml"): YAML,
    ("yaml", "air.workload.overrides:coerce_value"): YAML,
    ("yaml", "air.runs.sweep:_child_spec"): YAML,
    ("yaml", "air.web.app:_as_written"): YAML,
    # the server's account: bounded JSON into typed models (its own stored grants, re-read)
    ("json", "air.server.deps:json_body"): BODIES,
    ("json", "air.server.routes_runs:put_permissions"): BODIES,
    ("json", "air.server.visibility:change_permissions"): BODIES,
    # the nodes and ranks, as the run's account in its sandbox
    ("import", "air.launcher.zygote:_run_child"): CODE,
    ("import", "air.launcher.zygote:import_with_gc_off"): CODE,
    # text checks at submit (confined to the snapshot), and the walled build's own parse
    ("read", "air.environments.dependencies:_Parser.add_file"): REQUIREMENTS,
    ("read", "air.environments.dependencies:_local_name"): REQUIREMENTS,
    ("read", "air.environments.dependencies:_read_yaml_requirements"): REQUIREMENTS,
    ("yaml", "air.environments.dependencies:_read_yaml_requirements"): REQUIREMENTS,
    # python -m air.environments.walled, as the run's account in its sandbox
    ("install", "air.environments.build:build_environment"): BUILDS,
    ("install", "air.environments.build:_install"): BUILDS,
    ("read", "air.environments.build:_link_base_scripts"): BUILDS,
    # the call driver keeps the payload as bytes and its request as typed JSON; only the ranks unpickle
    ("read", "air.distributed.call_driver:main"): CALL,
    ("unpickle", "air.distributed.worker:main"): CALL,
    # the header a rank wrote, read as typed, bounded JSON by whoever drives the call (a server's call driver)
    ("json", "air.distributed.outcome:_split"): OUTCOMES,
    # read within 1 MiB by the supervisor or the call driver, parsed as JSON for its message
    ("json", "air.runs.reasons:error_file_reason"): ERROR_FILES,
    # only in the caller's own process
    ("unpickle", "air.distributed.outcome:CallResult.load"): OUTCOMES,
    ("unpickle", "air.distributed.outcome:RankRaised.rebuild"): OUTCOMES,
    # the door (server's account): bounded JSON and GraphQL, read to find the runs a request touches
    ("json", "air.server.mlflow_door:_json_body"): MLFLOW,
    ("json", "air.server.mlflow_door:Door._search"): MLFLOW,
    ("json", "air.server.mlflow_door:Door._tags_of"): MLFLOW,
    ("graphql", "air.server.mlflow_graphql:graphql_runs"): MLFLOW,
    # what the supervisor wrote from the typed spec
    ("yaml", "air.tracking.backfill:_parameters"): PARAMETERS,
    # a Ray node's agent (the Ray cluster's account)
    ("unpack", "air.backends.ray_agent:NodeAgent.unpack"): RAY,
    # a Slurm job's node launcher (the supervisor's account, under srun) reads what that supervisor wrote
    ("unpickle", "air.backends.slurm_node:_Node._wait_for_launch"): SLURM,
    # a walled server's Slurm job: the supervisor packs the run's own files as bytes; its account's node unpacks
    ("read", "air.backends.slurm:_Walls.place"): SLURM,
    ("unpack", "air.backends.slurm_node:_unpack_shipped"): SLURM,
    # the operator's file
    ("yaml", "air.config:load_config"): CONFIG,
}


def _modules() -> Iterator[tuple[str, Path]]:
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(("air", *parts)).removesuffix(".__init__")
        if parts[0] in CLIENT_SIDE or name in NOT_SCANNED:
            continue
        yield name, path


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    if isinstance(node, ast.Call):
        return _dotted(node.func) + "()"
    return ""


def _names(node: ast.AST) -> set[str]:
    """Every bare name and attribute name an expression mentions."""
    found: set[str] = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            found.add(sub.id)
        elif isinstance(sub, ast.Attribute):
            found.add(sub.attr)
        elif isinstance(sub, ast.arg):
            found.add(sub.arg)
    return found


def _writes(node: ast.Call) -> bool:
    """open(path, "ab") and the like: a file air writes, not one it reads."""
    mode = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "mode"), None)
    return isinstance(mode, ast.Constant) and isinstance(mode.value, str) and bool(set(mode.value) & set("wax"))


class _Scan(ast.NodeVisitor):
    """The consumers of one module, as (kind, module:function, line)."""

    def __init__(self, module: str) -> None:
        self.module = module
        self.stack: list[str] = []
        self.tainted: list[set[str]] = [set()]
        self.found: list[tuple[str, str, int]] = []
        #: A name bound by an import -> what it names (`from pickle import loads as l`: l -> pickle.loads).
        self.imported: dict[str, str] = {}

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.asname:
                self.imported[alias.asname] = alias.name

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for alias in node.names:
            self.imported[alias.asname or alias.name] = f"{node.module or ''}.{alias.name}"

    def where(self) -> str:
        return f"{self.module}:{'.'.join(self.stack) or '<module>'}"

    def add(self, kind: str, node: ast.AST) -> None:
        self.found.append((kind, self.where(), getattr(node, "lineno", 0)))

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.stack.append(node.name)
        self.generic_visit(node)
        self.stack.pop()

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.stack.append(node.name)
        params = {a.arg for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs)}
        tainted = {p for p in params if p in USER_NAMES} | set(self.tainted[-1])
        for _ in range(3):  # locals assigned from tainted names, to a small fixed point
            for sub in ast.walk(node):
                if isinstance(sub, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.NamedExpr)) and sub.value is not None:
                    targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target]
                    if _names(sub.value) & tainted:
                        for target in targets:
                            tainted |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
                elif isinstance(sub, (ast.For, ast.AsyncFor, ast.comprehension)) and _names(sub.iter) & tainted:
                    tainted |= {n.id for n in ast.walk(sub.target) if isinstance(n, ast.Name)}
        self.tainted.append(tainted)
        self.generic_visit(node)
        self.tainted.pop()
        self.stack.pop()

    visit_FunctionDef = _function
    visit_AsyncFunctionDef = _function

    def _user_named(self, node: ast.AST) -> bool:
        return self.module in USER_PATH_MODULES or bool(_names(node) & (self.tainted[-1] | USER_NAMES))

    @staticmethod
    def _own_source(node: ast.Call) -> bool:
        """exec/eval of a string literal or of a module constant (an ALL_CAPS name): air's own code."""
        code = node.args[0] if node.args else None
        return isinstance(code, ast.Constant) or (isinstance(code, ast.Name) and code.id.lstrip("_").isupper())

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = _dotted(func)
        first, _, more = name.partition(".")
        if first in self.imported:  # through its import: pickle.loads, whatever it is called here
            name = ".".join(filter(None, (self.imported[first], more)))
        head, _, attr = name.rpartition(".")
        if (head.split(".")[-1] in _PICKLERS and attr in {"load", "loads", "Unpickler"}) or name in {
                "Unpickler", "torch.load"}:
            self.add("unpickle", node)
        elif name in {"importlib.import_module", "import_module", "__import__"} or head == "runpy" or (
                name in {"exec", "eval"} and not self._own_source(node)):
            self.add("import", node)
        elif attr in {"extractall", "extract"} or name in {"shutil.unpack_archive", "unpack_archive"}:
            self.add("unpack", node)
        elif head.split(".")[0] == "graphql" and attr == "parse":
            self.add("graphql", node)
        elif (head == "yaml" and attr in _YAML_LOADS) or name.split(".")[-1] in _AIR_YAML | {"BoundedLoader"}:
            self.add("yaml", node)
        elif ((head, attr) in _JSON_LOADS or attr in _AIR_JSON or name in _AIR_JSON) and \
                (self.module.split(".")[1] in _HTTP_FACING or self.module in RUN_OUTPUT_MODULES):
            self.add("json", node)
        elif name == "open" and node.args and self._user_named(node.args[0]) and not _writes(node):
            self.add("read", node)
        elif isinstance(func, ast.Attribute) and attr in {"read_text", "read_bytes", "open"} and \
                head not in {"os", "io", "gzip", "tarfile", "zipfile", "webbrowser"} and self._user_named(func.value):
            self.add("read", node)
        self.generic_visit(node)

    def _argv(self, node: ast.List | ast.Tuple) -> None:
        words = {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
        first = _dotted(node.elts[0]) if node.elts else ""
        names_uv = "uv" in words or "pip" in words or re.search(r"(^|[._])uv($|[._(])", first) is not None
        if names_uv and words & _INSTALLER_WORDS:
            self.add("install", node)
        self.generic_visit(node)

    visit_List = _argv
    visit_Tuple = _argv


def scan() -> dict[tuple[str, str], list[int]]:
    """Every consumer of air's server-side modules: (kind, module:function) -> its lines."""
    found: dict[tuple[str, str], list[int]] = {}
    for module, path in _modules():
        visitor = _Scan(module)
        visitor.visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
        for kind, where, line in visitor.found:
            found.setdefault((kind, where), []).append(line)
    return found


def docs_table() -> dict[str, set[str]]:
    """docs/access.md's consumer table: row title -> the `module:function` names its last column lists."""
    text = DOCS.read_text(encoding="utf-8")
    start = text.index("## Where user content is consumed")
    rows: dict[str, set[str]] = {}
    for line in text[start:].splitlines()[1:]:
        if line.startswith("## "):
            break
        if not line.startswith("| ") or line.startswith("| what") or set(line) <= set("|- "):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        title = re.sub(r"[*`]", "", cells[0]).strip()
        rows[title] = set(re.findall(r"`(air\.[\w.]+:[\w.<>]+)`", cells[-1]))
    return rows


def test_scan_finds_every_kind_of_consumer(tmp_path: Path) -> None:
    """The scan itself: one of each kind in a module it reads is found (and nothing in a harmless one)."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import pickle, json, yaml, importlib, subprocess\n"
        "def a(blob):\n    return pickle.loads(blob)\n"
        "def b(uv, path):\n    subprocess.run([uv, 'pip', 'install', path])\n"
        "def c(name):\n    importlib.import_module(name)\n"
        "def d(text):\n    return yaml.safe_load(text)\n"
        "def e(request):\n    folder = request.root\n    return open(folder / 'x').read()\n"
        "def harmless(path):\n    return open(path).read() + json.dumps({})\n"
        "def f(blob):\n    from cloudpickle import loads as undo\n    return undo(blob)\n"
        "def g(query):\n    from graphql import parse\n    return parse(query)\n")
    visitor = _Scan("air.server.sample")
    visitor.visit(ast.parse(sample.read_text()))
    assert sorted((k, w) for k, w, _ in visitor.found) == [
        ("graphql", "air.server.sample:g"), ("import", "air.server.sample:c"), ("install", "air.server.sample:b"),
        ("read", "air.server.sample:e"), ("unpickle", "air.server.sample:a"), ("unpickle", "air.server.sample:f"),
        ("yaml", "air.server.sample:d")]


def test_what_a_run_writes_nested_past_the_parser_is_malformed_not_a_crash() -> None:
    """A rank's outcome header or TORCHELASTIC_ERROR_FILE nested 200,000 deep: the server's call driver or
    supervisor reads it as no outcome / no root cause (the rank's exit is reported), never a RecursionError
    that ends the reader."""
    from air.distributed.outcome import OUTCOME_MAGIC, parse_outcome
    from air.runs.reasons import error_file_reason

    deep = b"[" * 200_000
    assert parse_outcome(OUTCOME_MAGIC + deep + b"\n", 0) is None
    assert error_file_reason(deep) is None
    assert error_file_reason(b'{"message": ' + deep + b"}") is None


def test_every_consumer_of_user_content_is_in_the_table() -> None:
    found = scan()
    new = {key: lines for key, lines in found.items() if key not in CONSUMERS}
    gone = sorted(key for key in CONSUMERS if key not in found)
    assert not new, ("A consumer of user content that docs/access.md's table does not name (say where it runs "
                     "and as whom, then list it in CONSUMERS): "
                     + "; ".join(f"{kind} in {where} (line {', '.join(map(str, lines))})"
                                 for (kind, where), lines in sorted(new.items())))
    assert not gone, f"Listed in CONSUMERS but no longer found (remove them here and in docs/access.md): {gone}"


def test_the_docs_table_and_the_scan_table_agree() -> None:
    rows = docs_table()
    assert rows, "docs/access.md has no table under '## Where user content is consumed'"
    unknown_rows = sorted({row for row in CONSUMERS.values() if row not in rows})
    assert not unknown_rows, f"CONSUMERS names rows docs/access.md's table lacks: {unknown_rows}"
    wanted: dict[str, set[str]] = {}
    for (_, where), row in CONSUMERS.items():
        wanted.setdefault(row, set()).add(where)
    for row, named in rows.items():
        assert named == wanted.get(row, set()), (
            f"docs/access.md's row {row!r} names {sorted(named)}; the scan's table puts there "
            f"{sorted(wanted.get(row, set()))}")


if __name__ == "__main__":  # print what the scan finds (to update CONSUMERS)
    for (kind, where), lines in sorted(scan().items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"    ({kind!r}, {where!r}): ..., # lines {lines}")
    pytest.main([__file__, "-q"])
