"""MLflow as a tracking client only, in air's own processes that talk to a store and run no user code (a
run's supervisor, a call's driver, the back-fill, end and record helpers).

`import mlflow` with the SQL store costs ~1.8 s of CPU here, ~0.6 s of it optional libraries MLflow imports
when they are installed (pandas, numpy, pyarrow and scipy for its data sets, litellm for its judges), none of
which a tracking client uses. Every run's supervisor paid it. (fastapi stays: MLflow's genai imports it
unguarded.) In these processes they are refused as if not installed: MLflow imports them
guarded and goes on without them. Users' processes (nodes, ranks, the caller) never get this: their code
may use any of them.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

#: Top-level packages refused in a tracking-client process (each only imported by MLflow when installed).
UNUSED_BY_A_TRACKING_CLIENT = frozenset({"pandas", "numpy", "pyarrow", "scipy", "litellm",
                                         "sklearn", "matplotlib"})


class _Refuse(importlib.abc.MetaPathFinder):
    """First on `sys.meta_path`: an import of a refused package fails as a missing one does."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname.partition(".")[0] in UNUSED_BY_A_TRACKING_CLIENT:
            raise ModuleNotFoundError(f"No module named {fullname!r} (not loaded in air's tracking client)",
                                      name=fullname)
        return None


def tracking_client_only() -> None:
    """Call first in such a process's main (before anything imports MLflow); once is enough."""
    if not any(isinstance(finder, _Refuse) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Refuse())
