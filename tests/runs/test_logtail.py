"""tail_lines and LineCursor on real files. A cursor is read step by step as the test appends each next
piece, so nothing depends on timing."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from air.views.logtail import LineCursor, tail_lines


def naive_tail(data: bytes, n: int) -> list[str]:
    text = data.decode("utf-8", "replace")
    lines = text.split("\n")
    if text.endswith("\n"):
        lines.pop()
    if text == "":
        lines = []
    return [line.removesuffix("\r") for line in lines][-n:] if n > 0 else []


@pytest.mark.parametrize(
    "data",
    [b"", b"\n", b"one", b"one\n", b"one\ntwo", b"one\ntwo\n", b"\n\n\n", b"a\r\nb\r\n", "é\nü\n".encode(),
     b"bad \xff byte\n"],
)
@pytest.mark.parametrize("n", [0, 1, 2, 5])
@pytest.mark.parametrize("block", [1, 2, 3, 4096])
def test_tail_lines_matches_a_naive_reading(tmp_path: Path, data: bytes, n: int, block: int) -> None:
    path = tmp_path / "node_0.log"
    path.write_bytes(data)
    assert tail_lines(path, n, block_size=block) == naive_tail(data, n)


def test_tail_lines_of_a_large_file_reads_only_the_end(tmp_path: Path) -> None:
    path = tmp_path / "node_0.log"
    with open(path, "wb") as f:
        line = b"x" * 99 + b"\n"
        f.write(line * 200_000)  # 20 MB
        f.write(b"".join(f"last {i}\n".encode() for i in range(100)))
        f.write(b"partial")
    tail = tail_lines(path, 101)
    assert tail[0] == "last 0" and tail[-2] == "last 99" and tail[-1] == "partial"
    assert tail_lines(path, 3, block_size=7) == ["last 98", "last 99", "partial"]
    with pytest.raises(FileNotFoundError):
        tail_lines(tmp_path / "missing.log", 10)


def append(path: Path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


def test_cursor_yields_complete_lines_and_joins_partial_ones(tmp_path: Path) -> None:
    path = tmp_path / "node_0.log"
    path.write_bytes(b"first\nsec")
    cursor = LineCursor(path)
    seen = cursor.read()
    for piece in (b"ond\nthi", None, b"rd\n", b"\xc3", b"\xa9\n"):
        if piece is not None:
            append(path, piece)
        seen += cursor.read()
    assert seen == ["first", "second", "third", "é"]


def test_cursor_drains_at_the_end_and_keeps_an_unterminated_last_line(tmp_path: Path) -> None:
    path = tmp_path / "node_0.log"
    path.write_bytes(b"")
    cursor = LineCursor(path)
    append(path, b"a\n")
    assert cursor.read() == ["a"]
    append(path, b"b\nno newline at the end")  # the run ends and its last words land in the file
    assert cursor.read(final=True) == ["b", "no newline at the end"]
    assert cursor.read(final=True) == []


def test_cursor_waits_for_the_file_to_appear(tmp_path: Path) -> None:
    path = tmp_path / "attempt_0" / "node_1.log"
    path.parent.mkdir()
    cursor = LineCursor(path)
    assert cursor.read() == []
    path.write_bytes(b"hello\n")
    assert cursor.read(final=True) == ["hello"]
    never = LineCursor(tmp_path / "never.log")
    assert never.read() == [] and never.read(final=True) == []
    assert not (tmp_path / "never.log").exists()


def test_cursor_with_tail_starts_at_the_last_complete_lines(tmp_path: Path) -> None:
    path = tmp_path / "node_0.log"
    path.write_bytes(b"".join(f"{i}\n".encode() for i in range(1000)) + b"half")
    cursor = LineCursor(path)
    assert cursor.start_at_tail(2) == ["998", "999"]
    append(path, b" done\n")
    assert cursor.read(final=True) == ["half done"]
    at_end = LineCursor(path)
    assert at_end.start_at_tail(0) == [] and at_end.read(final=True) == []


def test_cursor_starts_over_when_the_file_is_truncated(tmp_path: Path) -> None:
    path = tmp_path / "node_0.log"
    path.write_bytes(b"old line 1\nold line 2\n")
    cursor = LineCursor(path)
    seen = cursor.read()
    path.write_bytes(b"new\n")
    seen += cursor.read(final=True)
    assert seen == ["old line 1", "old line 2", "new"]


def test_cursor_holds_no_file_between_reads(tmp_path: Path) -> None:
    """One poll loop reads every node's log: an abandoned cursor (Ctrl-C in `air logs --follow`) leaks
    nothing."""
    path = tmp_path / "node_0.log"
    path.write_bytes(b"a\nb\n")
    cursor = LineCursor(path)
    assert cursor.read() == ["a", "b"]
    assert str(path) not in {f.path for f in psutil.Process().open_files()}
