"""What a rank does as it trains is progress (issue 16): an MLflow metric (`mlflow.log_metric(s)`,
`MlflowClient.log_metric`/`log_batch`) and every torch optimizer step call `air.runtime.heartbeat()` in
ranks air starts. So a DDP rank that prints nothing (only rank 0 prints, as is usual) is not taken
for hung while it steps.

Installed by the rank entry point as an import hook, so nothing is imported until the rank itself
imports mlflow or torch; each hook runs right after its module is executed (before `mlflow`'s own
`__init__` re-exports the functions), or at once in a forked rank whose zygote imported it already.
"""

from __future__ import annotations

import functools
import importlib.abc
import sys
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


def _beating(func: Callable[P, R]) -> Callable[P, R]:
    from air.runtime import heartbeat

    @functools.wraps(func)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        heartbeat()
        return func(*args, **kwargs)

    wrapper._air_beats = True  # type: ignore[attr-defined]
    return wrapper


def _wrapping(*names: str) -> Callable[[ModuleType], None]:
    """Wrap functions (or `Class.method`s) of a module so that each call beats."""

    def wrap(module: ModuleType) -> None:
        for name in names:
            owner_name, _, attr = name.rpartition(".")
            owner = getattr(module, owner_name) if owner_name else module
            func = getattr(owner, attr, None)
            if callable(func) and not getattr(func, "_air_beats", False):
                setattr(owner, attr, _beating(func))

    return wrap


def _beat_after_optimizer_steps(module: ModuleType) -> None:
    """torch's hook common to every optimizer (`torch.optim.optimizer.register_optimizer_step_post_hook`)."""
    from air.runtime import heartbeat

    register = getattr(module, "register_optimizer_step_post_hook", None)
    if register is not None and not getattr(module, "_air_beats", False):
        register(lambda optimizer, args, kwargs: heartbeat())
        module.__dict__["_air_beats"] = True  # (a mark of air's own, not an attribute torch declares)


#: module → what to do once it has been executed.
_AFTER_IMPORT: dict[str, Callable[[ModuleType], None]] = {
    "mlflow.tracking.fluent": _wrapping("log_metric", "log_metrics"),
    "mlflow.tracking.client": _wrapping("MlflowClient.log_metric", "MlflowClient.log_batch"),
    "torch.optim.optimizer": _beat_after_optimizer_steps,
}


def _apply(fullname: str, module: ModuleType) -> None:
    try:
        _AFTER_IMPORT[fullname](module)
    except Exception:  # progress notes never break mlflow or torch
        pass


class _ProgressImportHook(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname not in _AFTER_IMPORT:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                run = spec.loader.exec_module

                def exec_module(module: ModuleType, run: Callable[[ModuleType], None] = run, name: str = fullname) -> None:
                    run(module)
                    _apply(name, module)

                spec.loader.exec_module = exec_module  # type: ignore[method-assign]
                return spec
            if spec is not None:
                return spec
        return None


def install(modules: Sequence[str] = tuple(_AFTER_IMPORT)) -> None:
    """Called by the rank entry point, before the user's function runs: modules already imported (a
    forked rank's zygote preloads torch and mlflow) get their hook now, the others as they are imported."""
    for fullname in modules:
        module = sys.modules.get(fullname)
        if module is not None:
            _apply(fullname, module)
    if not any(isinstance(f, _ProgressImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _ProgressImportHook())

