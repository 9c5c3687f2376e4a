"""What a rank should import before anything else, read off the function's own code: a warm start's
zygote imports it once before forking the ranks; a cold-started rank imports it first (AIR_RANK_PRELOAD),
with the cyclic GC off, which alone saves ~15 % of torch's import.

Only well-known third-party modules are ever preloaded (torch and what DDP pulls in): importing the
user's own modules in the zygote would run their top-level code once, outside any rank, where RANK and
friends are not set yet. Everything else each rank imports itself, as it would without air.

AIR_PRELOAD overrides the choice: `auto` (default), `none`, or a comma-separated list of modules.
"""

from __future__ import annotations

import dis
import functools
import os
import types
from collections.abc import Iterable, Mapping, Sequence

from air.settings import AIR_PRELOAD

#: DDP and FSDP import torch._dynamo when they wrap a model (about a second of every rank's start):
#: preloaded for code that names them.
_WRAPPER_MODULES = ("torch.nn.parallel", "torch.distributed.fsdp")
_WRAPPER_NAMES = frozenset({"DistributedDataParallel", "FullyShardedDataParallel", "fully_shard"})
_WRAPPER_PRELOAD = ("torch.distributed", "torch._dynamo")
_MAX_FUNCTIONS = 200
_MAX_DEPTH = 4


def _code_objects(code: types.CodeType) -> Iterable[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


class _Scan:
    """Walks functions (and the functions, classes and modules they name) collecting module names."""

    def __init__(self) -> None:
        self.modules: set[str] = set()
        self.names: set[str] = set()  # every global and attribute name the code uses
        self._seen: set[int] = set()

    def value(self, obj: object, depth: int) -> None:
        if len(self._seen) > _MAX_FUNCTIONS or depth > _MAX_DEPTH or id(obj) in self._seen:
            return
        if isinstance(obj, types.ModuleType):
            self.modules.add(obj.__name__)
        elif isinstance(obj, functools.partial):
            self._seen.add(id(obj))
            self.value(obj.func, depth)
            for item in (*obj.args, *obj.keywords.values()):
                self.value(item, depth + 1)
        elif isinstance(obj, types.MethodType):
            self.value(obj.__func__, depth)
        elif isinstance(obj, types.FunctionType):
            self._seen.add(id(obj))
            self.function(obj, depth)
        elif isinstance(obj, type):
            self.modules.add(obj.__module__)
            self.names.add(obj.__name__)
        else:
            module = getattr(type(obj), "__module__", None)
            if isinstance(module, str):
                self.modules.add(module)

    def function(self, func: types.FunctionType, depth: int) -> None:
        wrapped = getattr(func, "__wrapped__", None)
        if wrapped is not None:
            self.value(wrapped, depth)
        names: set[str] = set()
        for code in _code_objects(func.__code__):
            names.update(code.co_names)
            self.names.update(code.co_names)
            for instruction in dis.get_instructions(code):
                if instruction.opname == "IMPORT_NAME" and isinstance(instruction.argval, str):
                    self.modules.add(instruction.argval)
        for name in names:
            if name not in func.__globals__:
                continue
            target = func.__globals__[name]
            self.value(target, depth + 1)
            if isinstance(target, types.ModuleType):  # `helpers.train(...)`: follow the attribute too
                for attr in names & target.__dict__.keys():
                    member = target.__dict__[attr]
                    if isinstance(member, (types.FunctionType, type)):
                        self.value(member, depth + 1)
        for cell in func.__closure__ or ():
            try:
                self.value(cell.cell_contents, depth + 1)
            except ValueError:  # an empty cell
                continue


def _scan(func: object, args: Sequence[object], kwargs: Mapping[str, object] | None) -> _Scan:
    scan = _Scan()
    scan.value(func, 0)
    for value in (*args, *(kwargs or {}).values()):
        scan.value(value, 1)
    return scan


def preload_for(func: object, args: Sequence[object] = (), kwargs: Mapping[str, object] | None = None,
                env: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The modules every rank of this call imports first (once, in the zygote, for a warm start)."""
    setting = (env if env is not None else os.environ).get(AIR_PRELOAD, "auto").strip()
    if setting.lower() in ("", "none", "off", "0", "false"):
        return ()
    if setting.lower() != "auto":
        return tuple(m.strip() for m in setting.split(",") if m.strip())
    scan = _scan(func, args, kwargs)
    if not any(m == "torch" or m.startswith("torch.") for m in scan.modules):
        return ()
    if scan.names & _WRAPPER_NAMES or any(m.startswith(_WRAPPER_MODULES) for m in scan.modules):
        return ("torch", *_WRAPPER_PRELOAD)
    return ("torch",)
