"""The state machine and the retry policy are data: check the data says what the docs say."""

from __future__ import annotations

import pickle

import pytest

from air.errors import UserInputError
from air.store.states import (
    ATTEMPT_TRANSITIONS,
    RUN_TRANSITIONS,
    AttemptStatus,
    FailureClass,
    IllegalTransitionError,
    RetryDecision,
    RetryPolicy,
    RunStatus,
    StatusConflictError,
    can_transition,
    check_attempt_transition,
    check_transition,
    statuses,
)

TERMINAL = {"SUCCESS", "FAILED", "CANCELED", "TIMEDOUT", "INTERNAL_ERROR"}


def test_run_status_members_and_terminal_set() -> None:
    assert [s.value for s in RunStatus] == [
        "PENDING", "QUEUED", "RUNNING", "WAITING_FOR_RETRY", "TERMINATING",
        "SUCCESS", "FAILED", "CANCELED", "TIMEDOUT", "INTERNAL_ERROR",
    ]
    assert {s.value for s in RunStatus if s.is_terminal()} == TERMINAL
    assert RunStatus.active() == {s for s in RunStatus if s.value not in TERMINAL}
    assert {s.value for s in RunStatus if s.is_failure()} == {"FAILED", "TIMEDOUT", "INTERNAL_ERROR"}
    assert all(s.description for s in RunStatus)
    assert str(RunStatus.QUEUED) == "QUEUED" and RunStatus("QUEUED") is RunStatus.QUEUED


def test_attempt_status() -> None:
    assert [s.value for s in AttemptStatus] == [
        "RUNNING", "SUCCESS", "FAILED", "TIMEDOUT", "CANCELED", "INTERNAL_ERROR", "PREEMPTED",
    ]
    assert [s for s in AttemptStatus if not s.is_terminal()] == [AttemptStatus.RUNNING]
    assert ATTEMPT_TRANSITIONS[AttemptStatus.RUNNING] == {s for s in AttemptStatus if s.is_terminal()}
    check_attempt_transition(AttemptStatus.RUNNING, AttemptStatus.FAILED)
    with pytest.raises(IllegalTransitionError, match="FAILED; it cannot become SUCCESS"):
        check_attempt_transition(AttemptStatus.FAILED, AttemptStatus.SUCCESS)


def test_transition_table_is_total_and_terminal_states_are_final() -> None:
    assert set(RUN_TRANSITIONS) == set(RunStatus)
    for status, targets in RUN_TRANSITIONS.items():
        assert status not in targets, f"{status} → itself is not a transition"
        if status.is_terminal():
            assert not targets
        else:
            assert RunStatus.INTERNAL_ERROR in targets, f"{status} must be able to fail internally"
    # Every non-terminal state can reach a terminal one and nothing leads back to PENDING but a retry.
    assert {s for s, t in RUN_TRANSITIONS.items() if RunStatus.PENDING in t} == {RunStatus.WAITING_FOR_RETRY}
    # SUCCESS only from states that ran something.
    assert {s for s, t in RUN_TRANSITIONS.items() if RunStatus.SUCCESS in t} == {
        RunStatus.RUNNING, RunStatus.TERMINATING,
    }


@pytest.mark.parametrize(
    ("current", "new", "ok"),
    [
        ("PENDING", "QUEUED", True),
        ("QUEUED", "RUNNING", True),
        ("RUNNING", "WAITING_FOR_RETRY", True),
        ("WAITING_FOR_RETRY", "QUEUED", True),
        ("RUNNING", "TERMINATING", True),
        ("TERMINATING", "CANCELED", True),
        ("QUEUED", "CANCELED", True),  # nothing to tear down yet
        ("RUNNING", "CANCELED", False),  # processes exist: cancel goes through TERMINATING
        ("PENDING", "SUCCESS", False),
        ("SUCCESS", "RUNNING", False),
        ("CANCELED", "TERMINATING", False),
        ("TERMINATING", "RUNNING", False),
    ],
)
def test_transitions(current: str, new: str, ok: bool) -> None:
    assert can_transition(RunStatus(current), RunStatus(new)) is ok
    if ok:
        check_transition(RunStatus(current), RunStatus(new))
    else:
        with pytest.raises(IllegalTransitionError) as info:
            check_transition(RunStatus(current), RunStatus(new), run_id="run-260101-00000000")
        assert info.value.current == current and info.value.requested == new
        assert "run-260101-00000000" in str(info.value)


def test_illegal_transition_message_for_an_ended_run() -> None:
    with pytest.raises(IllegalTransitionError, match=r"already ended \(SUCCESS\); it cannot become RUNNING"):
        check_transition(RunStatus.SUCCESS, RunStatus.RUNNING)


def test_errors_pickle_with_their_fields() -> None:
    err = StatusConflictError("moved", run_id="run-260101-00000000", current="RUNNING", requested="QUEUED")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is StatusConflictError and isinstance(back, IllegalTransitionError)
    assert (back.run_id, back.current, back.requested, back.message) == (
        "run-260101-00000000", "RUNNING", "QUEUED", "moved",
    )
    assert back.kind == "CONFLICT" and back.exit_code == 1


def test_failure_class_maps_to_terminal_states() -> None:
    assert FailureClass.TIMEOUT.run_status is RunStatus.TIMEDOUT
    assert FailureClass.CANCEL.run_status is RunStatus.CANCELED
    for fc in (FailureClass.SETUP, FailureClass.USER_CODE, FailureClass.INFRASTRUCTURE):
        assert fc.run_status is RunStatus.FAILED
        assert fc.attempt_status is AttemptStatus.FAILED
    assert FailureClass.TIMEOUT.attempt_status is AttemptStatus.TIMEDOUT
    assert FailureClass.CANCEL.attempt_status is AttemptStatus.CANCELED


@pytest.mark.parametrize("failure", [FailureClass.USER_CODE, FailureClass.TIMEOUT, FailureClass.INFRASTRUCTURE])
def test_retry_policy_retries_up_to_max_retries(failure: FailureClass) -> None:
    policy = RetryPolicy(max_retries=2)
    assert policy.max_attempts == 3
    assert [policy.decide(a, failure).decision for a in range(3)] == [
        RetryDecision.RETRY, RetryDecision.RETRY, RetryDecision.FAIL,
    ]
    last = policy.decide(2, failure)
    assert last.final_status is failure.run_status
    assert "attempt 3 of 3" in last.message and "no retries left" in last.message
    assert policy.decide(0, failure).final_status is None


def test_retry_policy_never_retries_a_cancel() -> None:
    verdict = RetryPolicy(max_retries=5).decide(0, FailureClass.CANCEL)
    assert verdict.decision is RetryDecision.FAIL and verdict.final_status is RunStatus.CANCELED


def test_retry_policy_retries_setup_errors_but_says_so() -> None:
    verdict = RetryPolicy(max_retries=1).decide(0, FailureClass.SETUP)
    assert verdict.decision is RetryDecision.RETRY
    assert "Setup failed" in verdict.message and "fail the same way" in verdict.message
    assert RetryPolicy(max_retries=1).decide(1, FailureClass.SETUP).decision is RetryDecision.FAIL


def test_retry_policy_defaults_and_zero() -> None:
    assert RetryPolicy().max_retries == 3  # as in the reference
    verdict = RetryPolicy(max_retries=0).decide(0, FailureClass.USER_CODE)
    assert verdict.decision is RetryDecision.FAIL and "max_retries: 0" in verdict.message
    with pytest.raises(ValueError):
        RetryPolicy(max_retries=-1)


def test_statuses_parses_user_input() -> None:
    assert statuses(["running", "Failed", RunStatus.QUEUED]) == {
        RunStatus.RUNNING, RunStatus.FAILED, RunStatus.QUEUED,
    }
    with pytest.raises(UserInputError, match="Unknown run status 'RUNING'"):
        statuses(["RUNING"])


def test_a_hang_is_retried_within_max_retries_and_its_own_budget() -> None:
    from air.store.states import FailureClass, RetryDecision, RetryPolicy

    assert RetryPolicy(2).decide(0, FailureClass.HANG).decision is RetryDecision.RETRY
    assert RetryPolicy(2).decide(2, FailureClass.HANG).decision is RetryDecision.FAIL
    one = RetryPolicy(3, max_hang_retries=1)
    assert one.decide(0, FailureClass.HANG).decision is RetryDecision.RETRY
    verdict = one.decide(1, FailureClass.HANG)
    assert verdict.decision is RetryDecision.FAIL and verdict.message.startswith("Hung (no progress)")
    assert one.decide(1, FailureClass.USER_CODE).decision is RetryDecision.RETRY  # other classes keep theirs
    assert FailureClass.HANG.run_status.value == "FAILED"


def test_priority_classes_rank_and_read_back() -> None:
    """Issue 26: the stored rank orders the queue (higher first); a rank reads back as its class, and a row
    older than priorities (None) is NORMAL."""
    from air.store.states import PriorityClass

    assert [c.rank for c in (PriorityClass.BEST_EFFORT, PriorityClass.NORMAL, PriorityClass.CRITICAL)] == [0, 100, 200]
    assert [PriorityClass.from_rank(r) for r in (None, 0, 99, 100, 150, 200, 299)] == [
        PriorityClass.NORMAL, PriorityClass.BEST_EFFORT, PriorityClass.BEST_EFFORT, PriorityClass.NORMAL,
        PriorityClass.NORMAL, PriorityClass.CRITICAL, PriorityClass.CRITICAL]
