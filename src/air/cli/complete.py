"""Shell completion of run ids (`air get run <TAB>`, `air logs <TAB>`, `air cancel <TAB>`).

Completion runs on every TAB, so it reads the store once, by an indexed id prefix, and never creates
AIR_HOME or `runs.db` when there is none yet (no runs: nothing to offer). Any failure offers nothing
rather than printing into the user's shell.
"""

from __future__ import annotations

from typing import Literal

import click
from click.shell_completion import CompletionItem

#: At most this many ids offered at once (newest first).
MAX_ITEMS = 50


def _items(incomplete: str, statuses: Literal["all"] | None) -> list[CompletionItem]:
    try:
        from air.store.run_store import RunStore

        store = RunStore.if_exists()
        if store is None:
            return []
        with store:
            runs = store.list_runs(statuses=statuses, limit=MAX_ITEMS, id_prefix=incomplete or None)
        return [CompletionItem(r.id, help=f"{r.status.value}  {r.experiment}") for r in runs]
    except Exception:
        return []


def complete_run_id(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    """Every run's id (newest first) that starts with what was typed."""
    return _items(incomplete, "all")


def complete_active_run_id(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    """Only active runs: the ones `air cancel` can still end."""
    return _items(incomplete, None)
