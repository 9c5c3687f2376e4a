"""The CLI's side of `air server`: which commands go there, submitting a workload (spec + code snapshot,
uploading only the blobs the server lacks), and turning its streams back into the events the local
commands print. Printing itself is shared with the local commands (one printing path)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from air.client import ServerClient, server_client
from air.errors import UserInputError
from air.runs.follow import FollowEvent, Lines, LogSource, NewAttempt
from air.runs.views import run_from_dict


def remote() -> ServerClient | None:
    """The server this command goes to (AIR_SERVER_URL + AIR_TOKEN, or a `server` profile), or None."""
    from air.cli.main import settings

    return server_client(settings().profile)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def upload_snapshot(client: ServerClient, snapshot: Any) -> dict[str, Any]:
    """Ship a planned snapshot: build it here (content-addressed, cached), ask the server which blobs it
    lacks, upload those; returns the manifest the submit names."""
    from air.workload.snapshot import MODE_LINK
    from air.workload.snapshot_store import materialize_snapshot

    folder = materialize_snapshot(snapshot)
    files: list[dict[str, Any]] = []
    local: dict[str, Path] = {}
    for entry in snapshot.entries:
        path = folder / entry.path
        if entry.mode == MODE_LINK:
            files.append({"path": entry.path, "mode": entry.mode, "target": os.readlink(path)})
            continue
        digest = _sha256(path)
        local[digest] = path
        files.append({"path": entry.path, "mode": entry.mode, "sha256": digest})
    missing = client.post("/blobs/missing", {"digests": sorted(local)})["missing"]
    for digest in missing:
        client.call("PUT", f"/blobs/{digest}", data=local[digest].read_bytes())
    return {"name": snapshot.name, "files": files}


def submit_remote(client: ServerClient, path: str, overrides: list[str], *, idempotency_key: str | None,
                  dry_run: bool, watch_node: int | None = None) -> dict[str, Any]:
    """Validate the workload here (same errors as locally), then submit it to the server."""
    from air.workload.loading import load_workload
    from air.workload.snapshot import plan_snapshot

    spec = load_workload(path, overrides)
    if watch_node is not None and watch_node >= spec.num_nodes:
        raise UserInputError(f"--node {watch_node}: the workload has {spec.num_nodes} node(s).",
                             hint=f"Nodes are numbered 0 to {spec.num_nodes - 1}.")
    data = spec.to_yaml_dict()
    deps = (data.get("environment") or {}).get("dependencies")
    if isinstance(deps, str):  # a requirements file here: send its lines
        lines = [ln.strip() for ln in Path(deps).read_text(encoding="utf-8").splitlines()]
        data["environment"]["dependencies"] = [ln for ln in lines if ln and not ln.startswith("#")]
    manifest = None
    if spec.code_source is not None:
        snap = spec.code_source.snapshot
        git = snap.git
        snapshot = plan_snapshot(Path(snap.root_path), snap.include_paths,
                                 git_branch=git.branch if git else None, git_commit=git.commit if git else None)
        manifest = upload_snapshot(client, snapshot)
    from air.config import use_reserved_pool

    body = {"spec": data, "snapshot": manifest, "idempotency_key": idempotency_key, "dry_run": dry_run,
            "use_reserved_pool": use_reserved_pool()}
    return client.post("/runs", body)


def decode_events(items: Iterator[dict[str, Any]]) -> Iterator[FollowEvent]:
    """The server's follow stream as the events `air.runs.follow.follow` yields here."""
    for item in items:
        if "run" in item:
            yield run_from_dict(item["run"])
        elif "lines" in item:
            yield Lines(LogSource(item["label"], item["index"]), item["lines"], item.get("attempt"))
        elif "new_attempt" in item:
            yield NewAttempt(item["new_attempt"], item.get("previous"))


def follow_remote(client: ServerClient, run_id: str, **params: Any) -> Iterator[FollowEvent]:
    """A followed run through the server. A stream that ends before the run does (the server stopped)
    is an error that says how to reattach."""
    from air.client import RemoteError

    last = None
    for item in decode_events(client.stream(f"/runs/{run_id}/follow", **params)):
        if not isinstance(item, Lines | NewAttempt):
            last = item
        yield item
    pinned = params.get("attempt") is not None
    if params.get("live", True) and not pinned and (last is None or not last.is_terminal):
        raise RemoteError(f"The air server at {client.url} stopped streaming run {run_id} before it ended.",
                          code="UNAVAILABLE", kind="TRANSIENT",
                          hint=f"The run goes on there; reattach with: air logs {run_id} --follow")
