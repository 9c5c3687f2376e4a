"""`fn.func(...)`: the decorated function once, in this process, as rank 0 of a world of one.

Training code written for ranks calls `torch.distributed.init_process_group()`, which reads RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT from the environment and fails without them ("RANK expected,
but not set"). Running it once here (a quick check, a notebook) must not need torchrun's variables set
by hand, so `.func` sets the torchrun-compatible ones for the call and puts the environment back after.
Inside a launcher (RANK or WORLD_SIZE already set) nothing is touched.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")

#: What a launcher sets; either one present means a launcher (or the user) decided the world already.
_LAUNCHED_BY = ("RANK", "WORLD_SIZE")


@contextmanager
def world_of_one() -> Iterator[dict[str, str]]:
    """Rank 0 of 1 for the duration (a free MASTER_PORT held against other air launches); yields what it set.

    Variables the user already set (MASTER_PORT, say) are kept; only the missing ones are added, and
    exactly those are removed again afterwards.
    """
    if any(name in os.environ for name in _LAUNCHED_BY):
        yield {}
        return
    from air.launcher.ports import reserve_port

    with reserve_port() as port:
        wanted = {
            "RANK": "0",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_WORLD_SIZE": "1",
            "NODE_RANK": "0",
            "GROUP_RANK": "0",
            "ROLE_RANK": "0",
            "ROLE_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port.port),
        }
        added = {name: value for name, value in wanted.items() if name not in os.environ}
        os.environ.update(added)
        try:
            yield added
        finally:
            for name in added:
                os.environ.pop(name, None)


class _WorldOfOne(Generic[P, R]):
    """`func` run inside `world_of_one()`; a class, not a closure, so it pickles wherever `func` does."""

    def __init__(self, func: Callable[P, R]) -> None:
        functools.update_wrapper(self, func)  # __name__, __doc__, and the raw function at __wrapped__

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        with world_of_one():
            return self.__wrapped__(*args, **kwargs)  # type: ignore[attr-defined]


def run_as_world_of_one(func: Callable[P, R]) -> Callable[P, R]:
    """`func` wrapped to run inside `world_of_one()`; the raw function stays at `.__wrapped__`."""
    return _WorldOfOne(func)
