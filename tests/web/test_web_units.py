"""Small pieces of the pages: web sessions, error-line marks, run-list paging."""

from __future__ import annotations

import hashlib

from air.runs.reasons import mark_line
from air.store.run_store import Run, RunStore
from air.store.states import RunStatus
from air.views.query import run_list_page
from air.web.auth import WebSessions, WebUser


def test_web_sessions_keep_only_a_hash_and_end(tmp_path: object, air_home: object) -> None:
    """A session id is random, stored only as its sha256, and ends at logout or expiry."""
    now = [1000.0]
    store = RunStore()
    sessions = WebSessions(lambda: store, ttl_s=60, clock=lambda: now[0])
    session_id, row = sessions.open(WebUser("alice", token_id="tok_1"))
    assert len(session_id) >= 43 and row.token_id == "tok_1" and row.expires_at == 1060.0
    stored = store.reader().execute("SELECT session_sha256, user, csrf FROM web_sessions").fetchall()
    assert stored == [(hashlib.sha256(session_id.encode()).hexdigest(), "alice", row.csrf)]
    assert session_id not in str(stored)
    assert sessions.find(session_id) == row and sessions.find(session_id + "x") is None
    now[0] = 1061.0
    assert sessions.find(session_id) is None  # expired
    other, _ = sessions.open(WebUser("alice", token_id="tok_1"))  # and swept out when the next one comes
    assert store.reader().execute("SELECT COUNT(*) FROM web_sessions").fetchone()[0] == 1
    assert sessions.revoke(other) is not None and sessions.find(other) is None and sessions.revoke(other) is None


def test_mark_line() -> None:
    sig, error = mark_line("[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB")
    assert sig is not None and sig.name == "cuda_oom" and error
    assert mark_line("ValueError: bad lr") == (None, True)
    assert mark_line("epoch 3 val error 0.12") == (None, False)
    assert mark_line("    raise ValueError('x')") == (None, False)  # a frame, not the exception line


def test_run_list_pages_newest_first(tmp_path: object, air_home: object) -> None:
    store = RunStore()
    store.insert_runs(Run(id=f"run-261125-{i:08x}", experiment=f"e{i % 2}", status=RunStatus.SUCCESS,
                          accelerator_type="CPU_1xCPU", num_accelerators=1, num_nodes=1, submitted_at=1000.0 + i,
                          user="u") for i in range(7))
    first = run_list_page(store, per_page=3)
    assert [r["id"][-1] for r in first["runs"]] == ["6", "5", "4"] and first["has_next"]
    last = run_list_page(store, per_page=3, page=3)
    assert [r["id"][-1] for r in last["runs"]] == ["0"] and not last["has_next"]
    odd = run_list_page(store, experiment="e1", per_page=10)
    assert [r["id"][-1] for r in odd["runs"]] == ["5", "3", "1"]


def test_the_status_filter_all_that_the_page_offers_lists_every_run(tmp_path: object, air_home: object) -> None:
    """The page's status filter shows "all"; `/ui/runs?status=all` (a link or a hand-typed URL) is every
    run, as no filter is, not an error page; an unknown status still names the ones that exist."""
    import pytest

    from air.errors import UserInputError

    store = RunStore()
    store.insert_runs(Run(id=f"run-261125-{i:08x}", experiment="e", status=status, accelerator_type="CPU_1xCPU",
                          num_accelerators=1, num_nodes=1, submitted_at=1000.0 + i, user="u")
                      for i, status in enumerate((RunStatus.SUCCESS, RunStatus.RUNNING, RunStatus.FAILED)))
    unfiltered = run_list_page(store)
    for value in ("all", "ALL"):
        page = run_list_page(store, status=value)
        assert [r["id"] for r in page["runs"]] == [r["id"] for r in unfiltered["runs"]] and len(page["runs"]) == 3
        assert page["filters"]["status"] == ""  # shown as the filter's "all"; links carry no status
    with pytest.raises(UserInputError) as info:
        run_list_page(store, status="everything")
    assert info.value.hint is not None and "all, active, ended, " in info.value.hint


def test_tick_labels_never_repeat_when_the_range_is_small_beside_its_values() -> None:
    from air.web.charts import nice_ticks, tick_text

    for low, high in ((0.0199991, 0.02), (1000.1, 1000.5), (0.0, 0.02), (0.0, 230.0)):
        ticks = nice_ticks(low, high, 5)
        labels = [tick_text(t, ticks) for t in ticks]
        assert len(set(labels)) == len(labels), (low, high, labels)
    assert [tick_text(t, [0.0, 100.0, 200.0]) for t in (0.0, 100.0, 200.0)] == ["0", "100", "200"]
