"""Where air keeps its state: AIR_HOME (default ~/.air), and every name directly under it.

`AirHome` owns the top-level names, as submitit's `JobPaths` owns a job's: nothing else in air spells
`runs.db` or `envs/` (tests/test_home.py fails if one does). The names inside a run's or a call's
folder belong to `RunPaths`/`CallPaths` (air/store/paths.py), which take their root from here. A new
top-level file or folder is added here and nowhere else.
"""

from __future__ import annotations

import os
from pathlib import Path

from air.settings import AIR_HOME


def air_home(*, create: bool = True) -> Path:
    """The AIR_HOME folder, created on first use with owner-only permissions.

    `create=False` for readers (`--dry-run`, shell completion, reading config): they must leave no trace.
    """
    home = Path(os.environ.get(AIR_HOME) or Path.home() / ".air").expanduser().resolve()
    if create:
        home.mkdir(parents=True, exist_ok=True, mode=0o700)
    return home


class AirHome:
    """Every file and folder directly under AIR_HOME. Pure names: asking creates nothing.

    `AirHome()` is the current AIR_HOME, created (owner-only) unless `create=False`, for readers that must
    leave no trace; `AirHome(root)` names another one (tests, a path the caller already holds).
    """

    def __init__(self, root: Path | str | None = None, *, create: bool = True) -> None:
        self.root = Path(root) if root is not None else air_home(create=create)

    # -- files ---------------------------------------------------------------------------------------

    @property
    def config(self) -> Path:
        """`config.yaml`: the user's profiles and base environments (air/config.py)."""
        return self.root / "config.yaml"

    @property
    def runs_db(self) -> Path:
        """`runs.db`: the run store (SQLite in WAL mode: SQLite keeps `-wal`/`-shm` files beside it)."""
        return self.root / "runs.db"

    @property
    def mlflow_db(self) -> Path:
        """`mlflow.db`: the embedded MLflow tracking store (also WAL)."""
        return self.root / "mlflow.db"

    @property
    def mlflow_db_lock(self) -> Path:
        """Held while the embedded MLflow store is first created (two processes on a fresh AIR_HOME)."""
        return self.root / "mlflow.db.lock"

    @property
    def mlflow_recorder_lock(self) -> Path:
        """The detached MLflow recorders of local calls take turns on this lock."""
        return self.root / ".mlflow-recorder.lock"

    @property
    def secrets(self) -> Path:
        """`secrets.json`: the local secret store (0600)."""
        return self.root / "secrets.json"

    @property
    def images(self) -> Path:
        """`images.json`: the container images `air register image` resolved and pulled on this machine
        (url -> digest, local image id, python; air/environments/containers.py)."""
        return self.root / "images.json"

    @property
    def images_lock(self) -> Path:
        """Held while `images.json` is read and rewritten (and while an image is pulled)."""
        return self.root / "images.json.lock"

    @property
    def ui(self) -> Path:
        """`ui.json`: the running `air ui` processes and their addresses."""
        return self.root / "ui.json"

    @property
    def ui_lock(self) -> Path:
        """Held while `ui.json` is read and rewritten."""
        return self.root / "ui.json.lock"

    @property
    def ui_log(self) -> Path:
        """`ui.log`: the output of `air ui`'s MLflow server, kept out of the terminal."""
        return self.root / "ui.log"

    # -- folders -------------------------------------------------------------------------------------

    @property
    def runs(self) -> Path:
        """`runs/<run_id>/`: one folder per run (RunPaths names what is inside)."""
        return self.root / "runs"

    @property
    def calls(self) -> Path:
        """`calls/<run_id>/`: one folder per `@distributed` call (CallPaths names what is inside)."""
        return self.root / "calls"

    @property
    def snapshots(self) -> Path:
        """`snapshots/<sha256>/`: content-addressed code snapshots."""
        return self.root / "snapshots"

    @property
    def envs(self) -> Path:
        """`envs/<key>/`: content-addressed virtual environments."""
        return self.root / "envs"

    @property
    def mlartifacts(self) -> Path:
        """`mlartifacts/`: artifacts of the embedded MLflow store's experiments."""
        return self.root / "mlartifacts"

    @property
    def server(self) -> Path:
        """`server/`: what `air server` keeps beside the store (uploaded blobs, rebuilt snapshots, each
        user's secrets; air/server/uploads.py `ServerPaths` names what is inside)."""
        return self.root / "server"

    @property
    def tokens(self) -> Path:
        """`tokens/<profile>.token`: the `air server` API tokens `air login` saved, owner-only (0600),
        named by a profile's `token_path` so config.yaml never holds one."""
        return self.root / "tokens"

    @property
    def admission_lock(self) -> Path:
        """Held (flock) by the one admission loop of this AIR_HOME (air/runs/admission.py): `air server`'s
        thread, or the detached local loop `air run` starts while runs are queued."""
        return self.root / "admission.lock"

    @property
    def admission_log(self) -> Path:
        """What the detached local admission loop did (which runs it admitted, its errors)."""
        return self.root / "admission.log"

    @property
    def tracking_pending(self) -> Path:
        """`tracking_pending/<run_id>`: one empty marker per ended run whose attempts' MLflow runs are still
        to be made (the tracking server was away past the supervisor's wait); `air server` back-fills them
        and removes the marker (air/runs/reconcile.py `backfill_pending`)."""
        return self.root / "tracking_pending"

    @property
    def bin(self) -> Path:
        """`bin/`: the `ray` shim local workload nodes find first on their PATH."""
        return self.root / "bin"

    def __repr__(self) -> str:
        return f"AirHome({self.root})"

