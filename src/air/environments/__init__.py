"""`environment.dependencies` as virtual environments made with uv, layered on a base interpreter, cached.

Why it looks the way it does, in short (the module named with each point says more):

* **Layered, not copied** (`build`): a run's environment holds only what its dependencies add; the base
  interpreter's site folders are put behind the environment's own `site-packages` by a `.pth` file.
* **uv does not look at layered packages** (`build`): the packages the base already has are left out of
  uv's resolution, except those that a dependency needs in another version.
* **Cached by content** (`key`): the key covers what decides the result, and nothing else. A hit is a
  `stat`: no uv, no subprocess for the default base.
* **Built in place under a lock** (`cache`): at the final path `$AIR_HOME/envs/<key>/`, holding an `flock`,
  with the marker `.air-complete` written last; readers trust only the marker.

The modules, each importing only those listed before it:

* `layout`: the cache folder `$AIR_HOME/envs` and the files air keeps in an environment's folder.
* `dependencies`: dependency lines and requirements files, parsed into a `DependencySet`.
* `key`: `environment_key`, from the base interpreter's identity and the content of local files.
* `build`: building with uv and layering the environment on the base interpreter.
* `cache`: finding or building an environment under its lock (`ensure_environment`, `use_environment`),
  and running with it (`activation_env`).
* `listing`: `air env list` and `air env prune`.
"""

from __future__ import annotations

from air.environments.build import Log as Log
from air.environments.cache import (
    CacheState,
    Environment,
    activation_env,
    cache_state,
    ensure_environment,
    use_environment,
)
from air.environments.dependencies import (
    Confinement,
    Dependency,
    DependencySet,
    InstallOption,
    canonical_name,
    parse_dependencies,
)
from air.environments.key import environment_key
from air.environments.layout import envs_dir
from air.environments.listing import EnvInfo, list_environments, prune_environments

__all__ = [
    "CacheState",
    "Confinement",
    "Dependency",
    "DependencySet",
    "EnvInfo",
    "Environment",
    "InstallOption",
    "activation_env",
    "cache_state",
    "canonical_name",
    "ensure_environment",
    "environment_key",
    "envs_dir",
    "list_environments",
    "parse_dependencies",
    "prune_environments",
    "use_environment",
]
