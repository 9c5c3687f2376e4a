"""Where air keeps its state: AIR_HOME (default ~/.air). One function, so every part agrees."""

from __future__ import annotations

import os
from pathlib import Path


def air_home() -> Path:
    """The AIR_HOME folder, created on first use with owner-only permissions."""
    home = Path(os.environ.get("AIR_HOME") or Path.home() / ".air").expanduser().resolve()
    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    return home
