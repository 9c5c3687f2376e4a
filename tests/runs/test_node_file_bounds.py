"""What a run wrote in its node's work folder is read back by the supervisor or a server's call driver
(the server's account) only within a bound: a TORCHELASTIC_ERROR_FILE the run made huge is not read
whole into that process's memory, nor taken for a root cause."""

from __future__ import annotations

import json
from pathlib import Path

from air.backends.local import read_own_file
from air.runs.reasons import ERROR_FILE_MAX_BYTES, error_file_reason

RECORD = {"message": {"message": "ValueError: bad lr 7", "extraInfo": {"py_callstack": ""}}}


def test_a_file_past_its_bound_is_not_read(tmp_path: Path) -> None:
    small = tmp_path / "error_small.json"
    small.write_text(json.dumps(RECORD))
    assert read_own_file(small, ERROR_FILE_MAX_BYTES) == small.read_bytes()
    reason = error_file_reason(read_own_file(small, ERROR_FILE_MAX_BYTES))
    assert reason is not None and "ValueError: bad lr 7" in reason[0]

    huge = tmp_path / "error_huge.json"
    with huge.open("w") as fh:  # torch's JSON, padded past the bound
        fh.write(json.dumps({**RECORD, "pad": "x" * (ERROR_FILE_MAX_BYTES + 10)}))
    assert read_own_file(huge, ERROR_FILE_MAX_BYTES) is None
    assert read_own_file(huge) == huge.read_bytes()  # (no bound asked: a local call's own outcome)


def test_a_link_in_the_work_folder_is_never_followed(tmp_path: Path) -> None:
    secret = tmp_path / "root-only"
    secret.write_text(json.dumps(RECORD))
    link = tmp_path / "error_link.json"
    link.symlink_to(secret)
    assert read_own_file(link, ERROR_FILE_MAX_BYTES) is None
