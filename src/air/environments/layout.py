"""The cache's folder layout: `$AIR_HOME/envs/<key>/` and the files air keeps in it."""

from __future__ import annotations

from pathlib import Path

from air.home import AirHome

#: Bump when the folder layout or the key material changes: old entries then simply stop matching.
SCHEMA = 1

# Files inside an environment folder, beside the venv's own bin/, lib/, pyvenv.cfg.
COMPLETE = ".air-complete"  # written last: the environment is ready
LAST_USED = ".air-last-used"  # mtime = last time a run used it
META = "air-env.json"  # what it was built from
REQUIREMENTS = "air-requirements.txt"  # what uv was asked to install
EXCLUDES = "air-excludes.txt"  # base packages uv was told to leave alone (as overrides)
LAYER_PTH = "_air_base_layer.pth"  # puts the base interpreter's site folders behind ours
#: Under a server, `envs/.accounts/<account>/<key>/`: each Unix account's own environments and uv cache.
ACCOUNTS = ".accounts"


def account_envs_dir(account: str) -> Path:
    """`envs/.accounts/<account>`: a server account's own environments (and its uv cache), built as it."""
    return envs_dir(create=False) / ACCOUNTS / account


def envs_dir(*, create: bool = True) -> Path:
    """`$AIR_HOME/envs`, where environments live (one folder per key); `create=False` for lookups only."""
    path = AirHome(create=create).envs
    if create:
        path.mkdir(parents=True, exist_ok=True)
    return path

