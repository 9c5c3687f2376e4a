"""Where a snapshot's symbolic links really lead: each target resolved against the snapshot's own tree,
following every link on the way as the kernel will once the snapshot is a folder.

A lexical check (normpath of the link's folder joined with its target) is not enough: with `a/b -> ..`
in the tree, `up -> a/b/..` looks like it stays at `a`, but `a/b` is the snapshot's root, so `..` from
it is the folder above. `leaving_links` finds every such link; the server refuses a manifest with one,
and a local snapshot notes it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

#: Links followed while resolving one target, as Linux's own limit (ELOOP): a cycle ends here.
MAX_LINK_HOPS = 40


def resolves_inside(links: Mapping[str, str], path: str) -> bool:
    """Whether the link at `path` (a key of `links`: snapshot-relative path -> target) resolves to a place
    inside the snapshot, following every link of the tree on the way; a cycle, an absolute target, or a
    step above the root at any point counts as outside."""
    resolved = [part for part in path.split("/")[:-1] if part]
    pending = deque(links[path].split("/"))
    if links[path].startswith("/"):
        return False
    hops = 0
    while pending:
        part = pending.popleft()
        if part in ("", "."):
            continue
        if part == "..":
            if not resolved:
                return False
            resolved.pop()
            continue
        resolved.append(part)
        target = links.get("/".join(resolved))
        if target is not None:
            hops += 1
            if hops > MAX_LINK_HOPS or target.startswith("/"):
                return False
            resolved.pop()
            pending.extendleft(reversed(target.split("/")))
    return True


def leaving_links(links: Mapping[str, str]) -> list[str]:
    """The links of a tree (path -> target) whose fully resolved target is outside it, sorted."""
    return sorted(path for path in links if not resolves_inside(links, path))

