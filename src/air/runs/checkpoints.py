"""Where a run keeps checkpoints across its attempts (AIR_CHECKPOINT_DIR), and its latest one.

The local backend keeps them in the run's folder (`RunPaths.checkpoints`); a profile's
`checkpoint_root` (a folder every node mounts, or a URI such as `s3://bucket/air`) puts them at
`<root>/<run id>` instead, as a Ray cluster or a server needs.
"""

from __future__ import annotations

from pathlib import Path

from air.files import atomic_write_text
from air.store.paths import RunPaths


def checkpoint_location(run_id: str, checkpoint_root: str | None = None) -> str:
    """The run's checkpoint folder or URI, noted in the run's folder for `air get run`; a local folder is
    created (owner-only)."""
    if checkpoint_root and "://" in checkpoint_root:
        location = f"{checkpoint_root.rstrip('/')}/{run_id}"
    else:
        folder = Path(checkpoint_root).expanduser() / run_id if checkpoint_root else RunPaths(run_id).checkpoints()
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        location = str(folder)
    atomic_write_text(RunPaths(run_id).checkpoint_ref, location + "\n")
    return location


def latest_checkpoint_of(run_id: str, location: str | None = None) -> str | None:
    """The newest checkpoint the run left (see `air.runtime.latest_checkpoint`); None where there is
    none or the location is a URI (not listed from here)."""
    from air.runtime import newest_checkpoint

    base = Path(location) if location and "://" not in location else RunPaths(run_id).checkpoints()
    found = newest_checkpoint(base)
    return str(found) if found is not None else None

