"""Small pieces of the pages: the session cookie's signature, error-line marks, run-list paging."""

from __future__ import annotations

from air.runs.reasons import mark_line
from air.runs.states import RunStatus
from air.runs.store import Run, RunStore
from air.runs.views import run_list_page
from air.web.auth import SessionSigner


def test_session_cookie_is_signed() -> None:
    signer = SessionSigner(b"k" * 32)
    cookie = signer.dumps("tok-123")
    assert signer.loads(cookie) == "tok-123" and "tok-123" not in cookie
    payload, _, mac = cookie.rpartition(".")
    forged = SessionSigner(b"other" * 8).dumps("admin-token")
    assert signer.loads(forged) is None
    assert signer.loads(payload + "x." + mac) is None and signer.loads("garbage") is None


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
