"""A rank that logs an MLflow metric makes progress (issue 16): `mlflow.log_metric(s)` and
`MlflowClient.log_metric`/`log_batch` also call `air.runtime.heartbeat()` in ranks air starts.

Installed by the rank entry point as an import hook, so nothing is imported until the rank itself
imports mlflow; the hook wraps the functions right after their module is executed, before `mlflow`'s
own `__init__` re-exports them.
"""

from __future__ import annotations

import functools
import importlib.abc
import sys
from collections.abc import Callable, Sequence
from typing import Any

#: module → the names in it (functions, or `Class.method`) whose calls are progress.
_WRAPPED: dict[str, tuple[str, ...]] = {
    "mlflow.tracking.fluent": ("log_metric", "log_metrics"),
    "mlflow.tracking.client": ("MlflowClient.log_metric", "MlflowClient.log_batch"),
}


def _beating(func: Callable[..., Any]) -> Callable[..., Any]:
    from air.runtime import heartbeat

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        heartbeat()
        return func(*args, **kwargs)

    return wrapper


def _wrap(module: Any, names: Sequence[str]) -> None:
    for name in names:
        owner_name, _, attr = name.rpartition(".")
        owner = getattr(module, owner_name) if owner_name else module
        func = getattr(owner, attr, None)
        if callable(func):
            setattr(owner, attr, _beating(func))


class _MetricProgressHook(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        names = _WRAPPED.get(fullname)
        if names is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                run = spec.loader.exec_module

                def exec_module(module: Any, run: Callable[[Any], None] = run, names: Sequence[str] = names) -> None:
                    run(module)
                    try:
                        _wrap(module, names)
                    except Exception:  # noqa: BLE001 - progress notes never break mlflow
                        pass

                spec.loader.exec_module = exec_module  # type: ignore[method-assign]
                return spec
            if spec is not None:
                return spec
        return None


def install() -> None:
    """Called by the rank entry point (before the user's function runs, before any `import mlflow`)."""
    if "mlflow" in sys.modules:  # a forked rank whose zygote preloaded it: wrap in place
        for fullname, names in _WRAPPED.items():
            module = sys.modules.get(fullname)
            if module is not None:
                _wrap(module, names)
        return
    if not any(isinstance(f, _MetricProgressHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _MetricProgressHook())


__all__ = ["install"]
