"""The wire models (air.wire): every follow event survives encode -> decode as the same event,
a line of an unknown kind is skipped (a newer server's), and a run's times keep the API's RFC 3339 form."""

from __future__ import annotations

import time

import pytest

from air.errors import UserInputError
from air.server.deps import parse_request
from air.store.run_store import Run as StoredRun
from air.store.states import RunStatus
from air.views.follow import Lines, LogSource, NewAttempt
from air.views.query import event_from, run_dict
from air.wire import (
    ErrorBody,
    ErrorEvent,
    LinesEvent,
    NewAttemptEvent,
    Run,
    RunEvent,
    SubmitRequest,
    decode_event,
    encode_event,
)


def stored_run() -> StoredRun:
    now = time.time()
    return StoredRun(id="run-260101-0000abcd", experiment="e", status=RunStatus.RUNNING, accelerator_type="CPU_1xCPU",
                     num_accelerators=2, num_nodes=2, submitted_at=now - 5.25, started_at=now - 3.5,
                     current_attempt=0, user="alice")


def test_every_event_round_trips_through_one_line() -> None:
    run = stored_run()
    for item in (run, Lines(LogSource("node", 1), ["a", "b"], 0), NewAttempt(1, 0)):
        event = event_from(item)
        line = encode_event(event)
        assert line.endswith(b"\n") and line.count(b"\n") == 1
        assert decode_event(line) == event
    back = decode_event(encode_event(event_from(run)))
    assert isinstance(back, RunEvent) and back.run.status is RunStatus.RUNNING and back.run.is_terminal is False
    assert back.run.model_dump(mode="json")["started_at"] == run_dict(run)["started_at"]  # RFC 3339, ms, Z

    error = ErrorEvent(error=ErrorBody(code="UNAUTHENTICATED", kind="USER", message="revoked"))
    assert decode_event(encode_event(error)) == error
    assert isinstance(decode_event(b'{"lines": ["x"], "label": "rank", "index": 0}'), LinesEvent)
    assert isinstance(decode_event('{"new_attempt": 2}'), NewAttemptEvent)
    assert decode_event(b'{"metrics": {"loss": 1}}') is None  # a kind this client does not know
    assert decode_event(b"  \n") is None
    assert Run.model_validate({**run_dict(run), "new_field": 1}).model_extra == {
        **{k: v for k, v in run_dict(run).items() if k not in Run.model_fields}, "new_field": 1}


def test_a_malformed_body_names_each_wrong_field() -> None:
    with pytest.raises(UserInputError) as caught:
        parse_request(SubmitRequest, {"spec": [], "idempotency_key": "", "extra": 1}, "submit request")
    message = caught.value.message
    assert message.startswith("Malformed submit request: ") and "spec:" in message and "idempotency_key:" in message
    assert "extra: Extra inputs are not permitted" in message, message
    assert caught.value.hint is not None and "spec, snapshot, idempotency_key, dry_run" in caught.value.hint
