"""Hiding secret values in output, as text or as the raw bytes a pipe delivers.

The pump masks every line of a run that was given secrets before it writes the line anywhere, so no
file holds a value (issue 22); `air.workload.secrets.mask_secrets` masks text read back with the same
rules. The rules: every occurrence of a value becomes `***`, longest values first (a secret containing
another is hidden whole), and each line of a multi-line value (a PEM key) is hidden on its own, since
output arrives line by line. Matching is on UTF-8 bytes, which is the same as matching the decoded
text: UTF-8 is self-synchronising, so an encoded value cannot start inside another character.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import AnyStr

MASK = "***"


def needles(values: Iterable[str]) -> list[str]:
    """What to look for: each non-empty value and each non-blank line of a multi-line one, longest first."""
    found: set[str] = set()
    for value in values:
        if not value:
            continue
        found.add(value)
        if "\n" in value:
            found.update(line.rstrip("\r") for line in value.split("\n") if line.strip())
    return sorted(found, key=lambda n: (-len(n.encode("utf-8")), n))


class Redactor:
    """Masks a fixed set of secret values in text or bytes; `Redactor([])` changes nothing."""

    def __init__(self, values: Iterable[str]) -> None:
        found = needles(values)
        self._text = re.compile("|".join(re.escape(n) for n in found)) if found else None
        self._bytes = re.compile(b"|".join(re.escape(n.encode("utf-8")) for n in found)) if found else None
        #: Bytes of a piece of a long line held back until more arrives: one less than the longest value,
        #: so a value cut by a piece boundary is still whole in the next piece.
        self.overlap = max((len(n.encode("utf-8")) for n in found), default=1) - 1

    def __bool__(self) -> bool:
        return self._text is not None

    def mask_text(self, text: str) -> str:
        return self._text.sub(MASK, text) if self._text is not None and text else text

    def mask_bytes(self, data: bytes) -> bytes:
        return self._bytes.sub(MASK.encode(), data) if self._bytes is not None and data else data

    def split(self, data: bytes) -> tuple[bytes, bytes]:
        """A piece of an unfinished line: (what can be written now, masked; what to keep for later, raw).

        Everything but the last `overlap` bytes is final: a value that starts before them ends inside
        `data`. The cut moves past a value found across it, so that value is masked whole now.
        """
        if self._bytes is None:
            return data, b""
        cut = _final_cut(self._bytes, data, self.overlap)
        return self.mask_bytes(data[:cut]), data[cut:]

    def split_text(self, text: str) -> tuple[str, str]:
        """`split` for text read back from a log (a long line served in pieces)."""
        if self._text is None:
            return text, ""
        cut = _final_cut(self._text, text, self.overlap)  # (overlap counts bytes: at least as many characters)
        return self.mask_text(text[:cut]), text[cut:]


def _final_cut(pattern: re.Pattern[AnyStr], data: AnyStr, overlap: int) -> int:
    """Where `split` cuts `data`: `overlap` from its end, or past a value found across that point."""
    cut = len(data) - overlap
    if cut <= 0:
        return 0
    for match in pattern.finditer(data):
        if match.start() >= cut:
            break
        if match.end() > cut:
            return match.end()
    return cut

