"""tail_lines and follow on real files. follow is driven step by step through its injected `sleep`:
each time it would wait, the test appends the next piece, so nothing depends on timing."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from air.runs.logtail import follow, tail_lines


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


class Script:
    """Stands in for time.sleep: each call performs the next step (append bytes, stop, or nothing)."""

    def __init__(self, path: Path, steps: list[bytes | str | None]) -> None:
        self.path, self.steps, self.stopped, self.sleeps = path, list(steps), False, 0

    def stop(self) -> bool:
        return self.stopped

    def sleep(self, _seconds: float) -> None:
        self.sleeps += 1
        if not self.steps:
            raise AssertionError("follow() kept waiting after the script ended")
        step = self.steps.pop(0)
        if step == "STOP":
            self.stopped = True
        elif isinstance(step, bytes):
            with open(self.path, "ab") as f:
                f.write(step)


def run(path: Path, steps: list[bytes | str | None], **kw: object) -> list[str]:
    script = Script(path, steps)
    return list(follow(path, script.stop, poll=0.01, sleep=script.sleep, **kw))  # type: ignore[arg-type]


def test_follow_yields_complete_lines_and_joins_partial_ones(tmp_path: Path) -> None:
    path = tmp_path / "node_0.log"
    path.write_bytes(b"first\nsec")
    seen = run(path, [b"ond\nthi", None, b"rd\n", b"\xc3", b"\xa9\n", "STOP"])
    assert seen == ["first", "second", "third", "é"]


def test_follow_drains_after_stop_and_keeps_an_unterminated_last_line(tmp_path: Path) -> None:
    path = tmp_path / "node_0.log"
    path.write_bytes(b"")
    script = Script(path, [b"a\n"])

    def stop() -> bool:
        # The run ends and, in the same instant, its last words land in the file.
        if script.sleeps >= 1 and not script.stopped:
            with open(path, "ab") as f:
                f.write(b"b\nno newline at the end")
            script.stopped = True
        return script.stopped

    assert list(follow(path, stop, poll=0.01, sleep=script.sleep)) == ["a", "b", "no newline at the end"]


def test_follow_waits_for_the_file_to_appear(tmp_path: Path) -> None:
    path = tmp_path / "attempt_0" / "node_1.log"
    path.parent.mkdir()
    assert run(path, [None, b"hello\n", "STOP"]) == ["hello"]
    never = tmp_path / "never.log"
    assert run(never, [None, "STOP"]) == []


def test_follow_with_tail_starts_at_the_last_complete_lines(tmp_path: Path) -> None:
    path = tmp_path / "node_0.log"
    path.write_bytes(b"".join(f"{i}\n".encode() for i in range(1000)) + b"half")
    assert run(path, [b" done\n", "STOP"], tail=2) == ["998", "999", "half done"]
    assert run(path, ["STOP"], tail=0) == []


def test_follow_starts_over_when_the_file_is_truncated(tmp_path: Path) -> None:
    path = tmp_path / "node_0.log"
    path.write_bytes(b"old line 1\nold line 2\n")

    def truncate_then(step: bytes) -> Callable[[], None]:
        def go() -> None:
            path.write_bytes(step)
        return go

    script = Script(path, [])
    actions = [truncate_then(b"new\n"), lambda: setattr(script, "stopped", True)]

    def sleep(_s: float) -> None:
        actions.pop(0)()

    assert list(follow(path, script.stop, poll=0.01, sleep=sleep)) == ["old line 1", "old line 2", "new"]


def test_follow_closes_its_file_when_abandoned(tmp_path: Path) -> None:
    path = tmp_path / "node_0.log"
    path.write_bytes(b"a\nb\n")
    gen = follow(path, lambda: False, poll=0.01, sleep=lambda s: None)
    assert next(gen) == "a"
    assert str(path) in {f.path for f in psutil.Process().open_files()}
    gen.close()  # e.g. Ctrl-C in `air logs --follow`
    assert str(path) not in {f.path for f in psutil.Process().open_files()}
