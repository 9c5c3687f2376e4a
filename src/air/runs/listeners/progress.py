"""`attempt_<a>/progress.json` (`air get run` shows it): when the controller last looked, how long each
node process was quiet, which nodes' commands have ended (with when) while the attempt goes on."""

import json
import time

from air.files import atomic_write_text
from air.runs.transitions import Change, RunListener, Transition
from air.store.paths import RunPaths


class ProgressListener(RunListener):
    def on_transition(self, t: Transition) -> None:
        if t.kind is Change.PROGRESS and t.attempt is not None:
            body = {"at": time.time(), "processes": list(t.processes), "ended": list(t.ended)}
            try:
                atomic_write_text(RunPaths(t.run_id).progress(t.attempt), json.dumps(body))
            except OSError:
                pass  # the run folder is gone (pruned): nothing to show it to
