"""The run's own record of its states: one `status <STATE>` line each in its log (supervisor.log, or a
call's debug log)."""

from collections.abc import Callable

from air.runs.transitions import Change, RunListener, Transition


class AuditListener(RunListener):
    def __init__(self, say: Callable[[str], None]) -> None:
        self.say = say

    def on_transition(self, t: Transition) -> None:
        if t.kind is Change.RUN:
            self.say(f"status {t.after}")
