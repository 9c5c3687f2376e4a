"""`air env list | prune`: the cached environments built from `environment.dependencies`."""

from __future__ import annotations

import click

from air.cli.main import common, settings
from air.cli.output import envelope, fmt_time, print_table, stderr
from air.errors import UserInputError


@click.group()
def env() -> None:
    """Cached uv environments (one per distinct dependency set and base interpreter)."""


@env.command("list")
@common
def env_list() -> None:
    """Every cached environment, with its size and last use."""
    from dataclasses import asdict

    from air.environments import list_environments

    envs = list_environments()
    if settings().json:
        envelope({"environments": [{k: str(v) if k == "path" else v for k, v in asdict(e).items()} for e in envs]})
        return
    if not envs:
        print("No cached environments.")
        return
    print_table(["KEY", "SIZE", "CREATED", "LAST USED", "DEPENDENCIES"], [
        [e.key[:12], f"{e.size_bytes / 1e6:.1f} MB", fmt_time(e.created), fmt_time(e.last_used),
         _short(e.dependencies)] for e in envs])


def _short(lines: list[str], width: int = 80) -> str:
    """Packages before index options (`--find-links ...`): the packages are what tells environments apart."""
    packages = [line for line in lines if not line.startswith("-")]
    text = ", ".join(packages + [line for line in lines if line.startswith("-")])
    return text if len(text) <= width else text[: width - 1] + "…"


@env.command("prune")
@click.option("--older-than-days", type=float, default=None, help="Remove environments unused for this many days.")
@click.option("--all-unused", is_flag=True, help="Remove every environment not in use right now.")
@common
def env_prune(older_than_days: float | None, all_unused: bool) -> None:
    """Remove cached environments (never one being built or used)."""
    from air.environments import prune_environments

    if older_than_days is None and not all_unused:
        raise UserInputError("Say what to prune: --older-than-days N or --all-unused.")
    removed = prune_environments(older_than_days=older_than_days, all_unused=all_unused)
    if settings().json:
        envelope({"removed": [r.key for r in removed]})
    else:
        stderr(f"Removed {len(removed)} environment(s).")
