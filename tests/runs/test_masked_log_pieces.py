"""A log served by the server (`GET .../logs`, `air logs --download-to`) is read in bounded pieces: a run
that printed megabytes with no newline costs the reader at most a piece, and a secret cut by a piece
boundary is still hidden whole."""

from __future__ import annotations

from pathlib import Path

from air.views.query import LOG_PIECE_CHARS, masked_log
from air.workload.secrets import RunMasker

SECRET = "s3cr3t-" + "k" * 40


def test_a_long_line_is_served_in_pieces_and_a_secret_across_a_boundary_is_hidden(tmp_path: Path) -> None:
    before = "x" * (LOG_PIECE_CHARS - 10)  # the secret starts 10 characters before the first boundary
    long_line = before + SECRET + "y" * (4 * LOG_PIECE_CHARS)
    log = tmp_path / "node_0.log"
    log.write_text("first line " + SECRET + "\n" + long_line + "\n" + "last, no newline " + SECRET)
    masker = RunMasker("run-1", None, None)
    masker.values = [SECRET]

    pieces = list(masked_log(log, masker))
    served = "".join(pieces)
    assert SECRET not in served and not any("s3cr3t" in p for p in pieces)
    expected = log.read_text().replace(SECRET, "***")
    assert served == expected  # byte for byte otherwise
    assert max(len(p) for p in pieces) <= LOG_PIECE_CHARS + len(SECRET) + 1  # never the whole 5 MiB line
    assert len(pieces) > 4


def test_a_masker_that_cannot_split_still_bounds_the_pieces(tmp_path: Path) -> None:
    log = tmp_path / "node_0.log"
    log.write_text("z" * (3 * LOG_PIECE_CHARS) + "\nend\n")
    pieces = list(masked_log(log, str.upper))
    assert "".join(pieces) == ("Z" * (3 * LOG_PIECE_CHARS) + "\nEND\n")
    assert max(len(p) for p in pieces) <= LOG_PIECE_CHARS + 1
