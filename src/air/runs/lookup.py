"""Which run the user means: a full run id, a unique prefix, or the 8 hex digits people copy from a table,
with "did you mean" suggestions when it names none or several."""

from __future__ import annotations

import sqlite3

from air.errors import NotFoundError
from air.runs.paths import RUN_ID_RE, parse_run_id_fragment
from air.runs.schema import StoreDatabase


class RunLookup(StoreDatabase):
    """The id-resolution half of `RunStore.get_run`."""

    def _resolve(self, conn: sqlite3.Connection, text: str) -> str:
        fragment = parse_run_id_fragment(text)
        if RUN_ID_RE.match(fragment):
            if conn.execute("SELECT 1 FROM runs WHERE id = ?", (fragment,)).fetchone():
                return fragment
            matches: list[str] = []
        elif fragment.startswith("r"):
            # A range on the primary key: uses the index, unlike LIKE.
            matches = [r[0] for r in conn.execute(
                "SELECT id FROM runs WHERE id >= ? AND id < ? ORDER BY submitted_at DESC LIMIT 6",
                (fragment, fragment + "\uffff"),
            )]
        else:  # the random part, which is what people copy from a table; validated hex, no GLOB syntax
            matches = [r[0] for r in conn.execute(
                "SELECT id FROM runs WHERE id GLOB ? ORDER BY submitted_at DESC LIMIT 6",
                ("run-[0-9][0-9][0-9][0-9][0-9][0-9]-" + fragment + "*",),
            )]
        if len(matches) == 1:
            return matches[0]
        if matches:
            shown = ", ".join(matches[:5]) + (", …" if len(matches) > 5 else "")
            raise NotFoundError(
                f"{text!r} matches more than one run.",
                hint=f"Did you mean one of: {shown}? Give more of the id.",
            )
        suggestions = self._suggest(conn, fragment)
        hint = f"Did you mean {' or '.join(suggestions)}? " if suggestions else ""
        raise NotFoundError(
            f"Run {text} not found.",
            hint=hint + "`air list runs --all-status` lists the runs on this machine.",
        )

    def _suggest(self, conn: sqlite3.Connection, fragment: str) -> list[str]:
        """Ids that look like a mistyped `fragment`: the longest shared prefix, else close matches."""
        import difflib

        found: list[str] = []
        if fragment.startswith("run-"):
            for cut in range(len(fragment) - 1, len("run-000000-0") - 1, -1):
                prefix = fragment[:cut]
                found = [r[0] for r in conn.execute(
                    "SELECT id FROM runs WHERE id >= ? AND id < ? ORDER BY submitted_at DESC LIMIT 3",
                    (prefix, prefix + "\uffff"),
                )]
                if found:
                    return found
        recent = [r[0] for r in conn.execute(
            "SELECT id FROM runs ORDER BY submitted_at DESC, id DESC LIMIT 1000"
        )]
        if fragment.startswith("r"):
            return difflib.get_close_matches(fragment, recent, n=3, cutoff=0.8)
        by_hex = {rid[-8:]: rid for rid in recent}
        return [by_hex[h] for h in difflib.get_close_matches(fragment, list(by_hex), n=3, cutoff=0.75)]


__all__ = ["RunLookup"]
