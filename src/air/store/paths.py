"""Run ids and every file name under `$AIR_HOME/runs/<run_id>/`, in one class (as submitit's JobPaths).

Nothing else in air spells a file name of a run: the supervisor, the launcher and `air logs` all ask
`RunPaths` (whose root, `runs/`, is `AirHome`'s, air/home.py). Files that other processes read while
they change (spec, pid) are written through air/files.py, so a reader never sees half a file.

Run ids look like `run-260522-9f3a1c07`: a prefix, the UTC submit date (so ids sort roughly by day
and say when they were made) and 32 random bits (so two `air run` processes never pick the same id).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from air.errors import UserInputError
from air.home import AirHome

RUN_ID_PREFIX = "run-"
#: What a call's ranks run, in their node's work folder: the pickled function and arguments (the ranks
#: open it by this name).
CALL_PAYLOAD_FILE = "payload.pkl"
#: torch's variable naming the file a process writes its root cause to (torch.distributed.elastic's `@record`).
TORCHELASTIC_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"


def torchelastic_error_file(attempt: int, process: int) -> str:
    """Where one node process (a workload's node command, a call's rank) is told to write its root cause,
    in its node's work folder, as torchrun tells each worker (TORCHELASTIC_ERROR_FILE: torch's `@record`
    writes the exception and traceback there); one per attempt, so a retry never reads an earlier one."""
    return f"torchelastic-error-{attempt}-{process}.json"


RUN_ID_RE = re.compile(r"^run-[0-9]{6}-[0-9a-f]{8}$")
#: What a user may type to name a run: a full id, a prefix of one, or the random part (or its prefix).
_RUN_ID_FRAGMENT_RE = re.compile(r"^(run-[0-9]{0,6}(-[0-9a-f]{0,8})?|run|ru|r|[0-9a-f]{1,8})$")


def new_run_id(now: float | None = None) -> str:
    """A fresh random run id, `run-<yymmdd>-<8 hex>` (UTC date of `now`)."""
    day = time.strftime("%y%m%d", time.gmtime(time.time() if now is None else now))
    return f"{RUN_ID_PREFIX}{day}-{os.urandom(4).hex()}"  # = secrets.token_hex(4), without its import


def is_run_id(text: str) -> bool:
    """True for a well-formed full run id."""
    return bool(RUN_ID_RE.match(text))


def parse_run_id_fragment(text: str) -> str:
    """Validate what a user typed to name a run: a full id, a unique prefix of one, or its hex part.

    Returns it lower-cased and stripped; the store resolves it. Anything else (a path, a quote) is a
    UserInputError, so it never reaches a file name.
    """
    value = text.strip().lower() if isinstance(text, str) else ""
    if not value or not _RUN_ID_FRAGMENT_RE.match(value):
        raise UserInputError(
            f"{text!r} is not a run id.",
            hint="Run ids look like run-260522-9f3a1c07 (a unique prefix, or the 8 hex digits, also work); "
            "`air list runs --all-status` shows them.",
        )
    return value


class _RunIdPaths:
    """Paths named by a run id under AIR_HOME; the id is checked before any path is built from it."""

    def __init__(self, run_id: str, home: AirHome | Path | str | None = None) -> None:
        if not RUN_ID_RE.match(run_id):  # never build a path from something that is not an id
            raise UserInputError(f"{run_id!r} is not a run id.")
        self.run_id = run_id
        self.home = home if isinstance(home, AirHome) else AirHome(home)


class RunPaths(_RunIdPaths):
    """Every path of one run's folder. Pure names: nothing is created until `create()`/a write."""

    @property
    def folder(self) -> Path:
        """`$AIR_HOME/runs/<run_id>/`."""
        return self.home.runs / self.run_id

    @property
    def spec(self) -> Path:
        """The final workload spec (YAML merged with overrides) this run was started from."""
        return self.folder / "spec.yaml"

    @property
    def hyperparameters(self) -> Path:
        """`parameters:` of the workload, exported to the command as HYPERPARAMETERS_PATH."""
        return self.folder / "hyperparameters.yaml"

    @property
    def command(self) -> Path:
        """The node command as a bash script (what every node runs)."""
        return self.folder / "command.sh"

    @property
    def submission(self) -> Path:
        """The launch plan the supervisor executes (written once at submit)."""
        return self.folder / "submission.json"

    @property
    def code(self) -> Path:
        """Where the run's code snapshot is linked (CODE_SOURCE_PATH points below it)."""
        return self.folder / "code"

    @property
    def supervisor_log(self) -> Path:
        """What the supervisor did (transitions, retries, teardown); not the user's output."""
        return self.folder / "supervisor.log"

    @property
    def supervisor_pid(self) -> Path:
        """The supervisor's pid (the store also keeps pid and create time; this is for humans and ps)."""
        return self.folder / "supervisor.pid"

    @property
    def submit_environ(self) -> Path:
        """The environment `air run` was typed in (owner-only, 0600): the supervisor the admission loop starts
        later gets it, as it would have when `air run` started it (a node's environment is built from it); removed
        once that supervisor has started."""
        return self.folder / "environ.json"

    def attempt_dir(self, attempt: int) -> Path:
        """`attempt_<a>/`: one folder per attempt (0-based), so a retry never overwrites earlier logs."""
        if attempt < 0:
            raise ValueError(f"attempt must be >= 0, got {attempt}")
        return self.folder / f"attempt_{attempt}"

    def node_log(self, attempt: int, node: int) -> Path:
        """`attempt_<a>/node_<n>.log`: everything node n printed (all its ranks, merged) in attempt a."""
        if node < 0:
            raise ValueError(f"node must be >= 0, got {node}")
        return self.attempt_dir(attempt) / f"node_{node}.log"

    def tracking(self, attempt: int) -> Path:
        """`attempt_<a>/tracking.json`: the attempt's MLflow run (id, experiment, store), for `air get` links."""
        return self.attempt_dir(attempt) / "tracking.json"

    def mlflow_env(self, attempt: int) -> Path:
        """The attempt's MLflow variables for its nodes or ranks (written once its MLflow run exists)."""
        return self.attempt_dir(attempt) / "mlflow_env.json"

    def mlflow_hook(self, attempt: int) -> Path:
        """`attempt_<a>/mlflow_hook/`: the `sitecustomize.py` first on a workload node's PYTHONPATH that hands
        its processes the attempt's MLflow run (air/tracking/node_hook.py)."""
        return self.attempt_dir(attempt) / "mlflow_hook"

    @property
    def waiting(self) -> Path:
        """`waiting.json`: what a RUNNING run's nodes wait for before they start (its MLflow run), while they
        do (the supervisor writes and removes it; `air list runs`, `--watch` and the pages say it)."""
        return self.folder / "waiting.json"

    def progress(self, attempt: int) -> Path:
        """`attempt_<a>/progress.json`: how long each node process has been quiet (the run controller)."""
        return self.attempt_dir(attempt) / "progress.json"

    def stacks(self, attempt: int, process: str) -> Path:
        """`attempt_<a>/stacks/<process>.txt` ("node 1" → node_1.txt): Python stacks saved at a hang."""
        return self.attempt_dir(attempt) / "stacks" / f"{process.replace(' ', '_')}.txt"

    @property
    def checkpoint_ref(self) -> Path:
        """`checkpoint_dir`: the run's AIR_CHECKPOINT_DIR (a folder or URI), noted by whoever drives it."""
        return self.folder / "checkpoint_dir"

    def checkpoints(self) -> Path:
        """`checkpoints/`: the run's checkpoint folder on the local backend (AIR_CHECKPOINT_DIR), kept
        across its attempts."""
        return self.folder / "checkpoints"

    def attempts(self) -> list[int]:
        """Attempt indices that have a folder on disk, in order."""
        return sorted(_indices(self.folder, "attempt_", ""))

    def node_logs(self, attempt: int) -> dict[int, Path]:
        """Node index → log path for the node logs of `attempt` that exist."""
        folder = self.attempt_dir(attempt)
        return {n: folder / f"node_{n}.log" for n in sorted(_indices(folder, "node_", ".log"))}

    def create(self) -> Path:
        """Create the run folder (owner-only) and return it."""
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        return self.folder

    def create_attempt(self, attempt: int) -> Path:
        """Create `attempt_<a>/` and return it."""
        folder = self.attempt_dir(attempt)
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        return folder

    def __repr__(self) -> str:
        return f"RunPaths({self.folder})"


class CallPaths(RunPaths):
    """A `@distributed` call's names in its run folder (a call is a run of kind `call`): its rank logs per
    attempt, beside the node logs (`attempt_<a>/rank_<r>.log`), and what a call `air server` drives keeps."""

    def rank_log(self, rank: int, attempt: int | None = None) -> Path:
        """`attempt_<a>/rank_<r>.log`: everything rank r printed in attempt a (None: the latest attempt)."""
        if rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank}")
        return self.attempt_dir(self._latest() if attempt is None else attempt) / f"rank_{rank}.log"

    def rank_log_list(self, world_size: int, attempt: int) -> list[Path]:
        """The log of every rank 0..world_size-1 of `attempt`, whether written yet or not."""
        return [self.rank_log(r, attempt) for r in range(world_size)]

    def rank_logs(self, attempt: int | None = None) -> dict[int, Path]:
        """Rank → log path for the rank logs of `attempt` (None: the latest) that exist."""
        folder = self.attempt_dir(self._latest() if attempt is None else attempt)
        return {r: folder / f"rank_{r}.log" for r in sorted(_indices(folder, "rank_", ".log"))}

    def mlflow_request(self, attempt: int) -> Path:
        """Made by the first rank that imports mlflow: the caller then creates the MLflow run
        (air/distributed/mlflow_gate.py looks for it beside `mlflow_env`)."""
        return self.mlflow_env(attempt).with_name("mlflow_request")

    def mlflow_record_job(self, attempt: int) -> Path:
        """What the detached MLflow recorder records (an attempt no rank asked MLflow about)."""
        return self.attempt_dir(attempt) / "mlflow_record.json"

    @property
    def request(self) -> Path:
        """A call `air server` drives: what to run (shape, name, timeout, retries), for its driver."""
        return self.folder / "request.json"

    @property
    def payload(self) -> Path:
        """A call `air server` drives: the pickled function and arguments its client sent."""
        return self.folder / CALL_PAYLOAD_FILE

    @property
    def driver_log(self) -> Path:
        """A call `air server` drives: its driver's own output (air's lines, not the ranks')."""
        return self.folder / "driver.log"

    @property
    def result(self) -> Path:
        """A call `air server` drives: every rank's value, or the error (pickled), for its client."""
        return self.folder / "result.pkl"

    def _latest(self) -> int:
        attempts = self.attempts()
        return attempts[-1] if attempts else 0

    def __repr__(self) -> str:
        return f"CallPaths({self.folder})"


def _indices(folder: Path, prefix: str, suffix: str) -> list[int]:
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        if name.startswith(prefix) and name.endswith(suffix):
            middle = name[len(prefix) : len(name) - len(suffix)]
            if middle.isdigit():
                out.append(int(middle))
    return out


def process_tag(run_id: str) -> str:
    """AIR_PROCESS_TAG of every process a run starts, on any node (cancel and reconcile find them by it)."""
    return f"air-run-{run_id}"
