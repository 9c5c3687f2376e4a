"""`@distributed(remote=True)`: submit the call as a run on the profile's backend."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from air.distributed.shape import CallSettings
from air.errors import BackendUnavailableError


def run_remote(func: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any],
               settings: CallSettings) -> list[Any]:
    raise BackendUnavailableError(
        "remote=True needs a remote backend, and none is configured.",
        hint="Use remote=False to run on this machine's accelerators.",
    )
