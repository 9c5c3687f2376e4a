"""`air logs ID`: a node's log of an attempt; --follow while it runs, --download-to for all nodes."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import click

from air.cli.complete import complete_run_id
from air.cli.main import common, settings
from air.cli.output import event, stderr
from air.errors import NotFoundError
from air.runs.paths import RunPaths
from air.runs.store import RunStore


def masker_for(run_id: str) -> Callable[[str], str]:
    """Hide the run's secret values should the user's code print them."""
    try:
        plan = json.loads(RunPaths(run_id).submission.read_text())
        refs = plan.get("secret_refs") or {}
        if not refs:
            return lambda text: text
        from air.workload.secrets import mask_secrets, resolve_secrets

        values = list(resolve_secrets(refs).values())
        return lambda text: mask_secrets(text, values)
    except Exception:
        return lambda text: text


@click.command()
@click.argument("run_id", shell_complete=complete_run_id)
@click.option("--node", default=0, show_default=True, type=click.IntRange(min=0), help="Node rank.")
@click.option("--retry", "attempt", default=None, type=click.IntRange(min=0),
              help="Attempt, 0-based (default: the latest).")
@click.option("--tail", default=None, type=click.IntRange(min=0), help="Only the last N lines (default: 10000).")
@click.option("--follow", is_flag=True, help="Keep printing new lines until the run ends.")
@click.option("--download-to", "download_to", default=None, type=click.Path(file_okay=False),
              help="Copy every node's log of the attempt to DIR/logs/node_<n>.log.")
@common
def logs(run_id: str, node: int, attempt: int | None, tail: int | None, follow: bool, download_to: str | None) -> None:
    """Print a node's log (all its ranks, merged, as they wrote it)."""
    from air.runs.logtail import follow as follow_file
    from air.runs.logtail import tail_lines

    store = RunStore()
    run = store.get_run(run_id)
    paths = RunPaths(run.id)
    if run.current_attempt is None:
        if not follow:
            raise NotFoundError(f"Run {run.id} has not started an attempt yet ({run.status.value}).",
                                hint=f"Wait for it with: air logs {run.id} --follow")
    attempt_index = store.get_attempt(run.id, attempt).index if run.current_attempt is not None else 0
    if node >= run.num_nodes:
        raise NotFoundError(f"Run {run.id} has {run.num_nodes} node(s); there is no node {node}.",
                            hint=f"Nodes are numbered 0 to {run.num_nodes - 1}.")
    if download_to:
        target = Path(download_to) / "logs"
        target.mkdir(parents=True, exist_ok=True)
        copied = []
        for n, path in paths.node_logs(attempt_index).items():
            shutil.copyfile(path, target / f"node_{n}.log")
            copied.append(str(target / f"node_{n}.log"))
        stderr(f"Copied {len(copied)} log(s) of attempt {attempt_index} to {target}")
        return
    path = paths.node_log(attempt_index, node)
    mask = masker_for(run.id)
    json_mode = settings().json

    def out(line: str) -> None:
        line = mask(line)
        if json_mode:
            event("LOG", node=node, attempt=attempt_index, line=line)
        else:
            sys.stdout.write(line + "\n")

    if follow:
        def stop() -> bool:
            return store.get_run(run.id).is_terminal

        for line in follow_file(path, stop, tail=tail):
            out(line)
            sys.stdout.flush()
        return
    if not path.exists():
        raise NotFoundError(f"No log for node {node} of attempt {attempt_index} of run {run.id}.")
    for line in tail_lines(path, tail if tail is not None else 10000):
        out(line)
