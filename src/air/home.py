"""Where air keeps its state: AIR_HOME (default ~/.air). One function, so every part agrees."""

from __future__ import annotations

import os
from pathlib import Path

from air.settings import AIR_HOME


def air_home(*, create: bool = True) -> Path:
    """The AIR_HOME folder, created on first use with owner-only permissions.

    `create=False` for readers (`--dry-run`, shell completion, reading config): they must leave no trace.
    """
    home = Path(os.environ.get(AIR_HOME) or Path.home() / ".air").expanduser().resolve()
    if create:
        home.mkdir(parents=True, exist_ok=True, mode=0o700)
    return home
