"""The cache's folder layout: `$AIR_HOME/envs/<key>/`, the files air keeps in it, and writing them."""

from __future__ import annotations

import os
from pathlib import Path

from air.home import air_home

#: Bump when the folder layout or the key material changes: old entries then simply stop matching.
_SCHEMA = 1

# Files inside an environment folder, beside the venv's own bin/, lib/, pyvenv.cfg.
_COMPLETE = ".air-complete"  # written last: the environment is ready
_LAST_USED = ".air-last-used"  # mtime = last time a run used it
_META = "air-env.json"  # what it was built from
_REQUIREMENTS = "air-requirements.txt"  # what uv was asked to install
_EXCLUDES = "air-excludes.txt"  # base packages uv was told to leave alone (as overrides)
_LAYER_PTH = "_air_base_layer.pth"  # puts the base interpreter's site folders behind ours


def envs_dir(*, create: bool = True) -> Path:
    """`$AIR_HOME/envs`, where environments live (one folder per key); `create=False` for lookups only."""
    if not create:
        return air_home(create=False) / "envs"
    path = air_home() / "envs"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
