"""Parameters and tags as MLflow accepts them: flattened, valid keys, bounded values.

MLflow rejects a whole batch for one bad key or over-long value; a workload's `parameters` are user
input, so air fixes what it can (and warns) instead of losing the run's parameters.
"""

from __future__ import annotations

import json
import posixpath
import re
from collections.abc import Mapping

from air.tracking.store import Warn

# MLflow's limits (mlflow.utils.validation), copied so that this module imports without mlflow.
MAX_KEY_LENGTH = 250
MAX_PARAM_VALUE_LENGTH = 6000
MAX_TAG_VALUE_LENGTH = 8000
MAX_PARAMS_PER_BATCH = 100

_INVALID_KEY_CHARS = re.compile(r"[^/\w.\- :]")


def flatten_params(params: Mapping[str, object], prefix: str = "") -> dict[str, str]:
    """Nested mappings become dotted keys (`optim.lr`); lists and other values become text.

    Lists are JSON rather than `a.0`, `a.1` keys: a list of layer sizes is one parameter to a reader.
    """
    flat: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            flat.update(flatten_params(value, name))
        elif isinstance(value, (list, tuple, Mapping)):
            flat[name] = json.dumps(value, default=str)
        else:
            flat[name] = str(value)
    return flat


def clean_key(key: str) -> str:
    """A key MLflow accepts: letters, digits, `_ - . / : space`; no `..`, leading or double `/`."""
    cleaned = _INVALID_KEY_CHARS.sub("_", key)
    norm = posixpath.normpath(cleaned) if cleaned else cleaned
    if not cleaned or norm != cleaned or norm == "." or norm.startswith(("..", "/")):
        cleaned = cleaned.replace("/", "_")
    return cleaned or "_"


def _clean(items: Mapping[str, str], limit: int, kind: str, warn: Warn) -> dict[str, str]:
    """Keys made valid, over-long keys dropped, over-long values cut; one warning per kind of fix."""
    out: dict[str, str] = {}
    cut: list[str] = []
    dropped: list[str] = []
    for raw_key, value in items.items():
        key = clean_key(raw_key)
        if len(key) > MAX_KEY_LENGTH:
            dropped.append(raw_key[:40] + "...")
            continue
        if len(value) > limit:
            value = value[: limit - 3] + "..."
            cut.append(key)
        out[key] = value
    if cut:
        warn(f"tracking: {kind} values cut to MLflow's {limit} characters: {', '.join(cut[:10])}")
    if dropped:
        warn(
            f"tracking: {kind}s with keys over {MAX_KEY_LENGTH} characters not logged: "
            + ", ".join(dropped[:10])
        )
    return out


def clean_tags(tags: Mapping[str, object], warn: Warn) -> dict[str, str]:
    """Tags as MLflow wants them: `None` dropped, values stringified and bounded."""
    as_text = {str(k): str(v) for k, v in tags.items() if v is not None}
    return _clean(as_text, MAX_TAG_VALUE_LENGTH, "tag", warn)


def clean_params(params: Mapping[str, object], warn: Warn) -> dict[str, str]:
    """`parameters` flattened and bounded, ready for `log_batch`."""
    return _clean(flatten_params(params), MAX_PARAM_VALUE_LENGTH, "parameter", warn)
