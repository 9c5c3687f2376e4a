"""Where MLflow data goes, and how air talks to it without ever failing a run.

The embedded default is `sqlite:///$AIR_HOME/mlflow.db` (MLflow 3 refuses a plain folder store) with
artifacts under `$AIR_HOME/mlartifacts`; `MLFLOW_TRACKING_URI`, when set, wins, so a team's server works
unchanged. MLflow is imported inside functions only: `import air.tracking` stays cheap, and so do the
launcher and the CLI paths that never touch tracking.

Concurrency (measured, 2 cores): MLflow's SQLAlchemy store runs `PRAGMA busy_timeout = 20000` on every
session, so plain `mlflow.log_metric` from many rank processes into one SQLite file waits for the lock
instead of failing with "database is locked" (4 processes x 200 calls and 8 x 300 all land). air adds
WAL journaling to the embedded file so readers (the UI, `air get run`, the sampler) never block writers,
and a file lock around first creation so two supervisors on a fresh AIR_HOME don't race MLflow's
schema migration; the file is made whole under a private name and linked into place, so no process
(one that took no lock included) ever opens a half-migrated store. MLflow's migrations run once per user
and MLflow version: a new store starts as a copy of the first one made (`schema_template`).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import sqlite3
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from air.home import AirHome
from air.settings import AIR_TRACKING, switched

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Experiment

Warn = Callable[[str], None]

_logger = logging.getLogger("air.tracking")

#: Experiment tag that tells the UI (and readers of the reference) that node logs are artifacts.
SHOW_LOGS_TAG = "air-show-logs"

#: HTTP limits applied to air's own calls against an http(s) tracking server, unless the user set the
#: variable: an unreachable server then costs seconds, not MLflow's default ~4 minutes of retries.
HTTP_LIMITS: dict[str, str] = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "5",
}
#: Per-request timeout for artifact uploads (a large log needs longer than a metadata call).
HTTP_ARTIFACT_TIMEOUT_S = 30


def default_warn(message: str) -> None:
    """Fallback for callers that pass no `warn`: the `air.tracking` logger."""
    _logger.warning(message)


def embedded_uri() -> str:
    """The embedded store's URI: an absolute SQLite path under AIR_HOME."""
    return f"sqlite:///{AirHome().mlflow_db}"


def artifact_root() -> Path:
    """Folder holding the embedded store's artifacts (one sub-folder per experiment)."""
    return AirHome().mlartifacts


def tracking_uri() -> str:
    """MLFLOW_TRACKING_URI when set (a team's server wins), else the embedded SQLite store."""
    return os.environ.get("MLFLOW_TRACKING_URI") or embedded_uri()


def is_embedded(uri: str) -> bool:
    """Whether `uri` is this AIR_HOME's embedded store (so its experiments get air's artifact root)."""
    if not uri.startswith("sqlite:///"):
        return False
    path = uri.removeprefix("sqlite:///")
    try:
        return Path(path).resolve() == AirHome().mlflow_db.resolve()
    except OSError:
        return False


def is_http(uri: str) -> bool:
    """Whether air's calls go over the network (and so need short timeouts)."""
    return uri.startswith(("http://", "https://"))


def short_message(exc: BaseException, limit: int = 300) -> str:
    """First line of an exception, bounded: MLflow errors can carry whole tracebacks or HTML pages."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---- short HTTP limits, scoped and thread-safe -------------------------------------------------------

_http_lock = threading.Lock()
_http_depth = 0
_http_set: list[str] = []


@contextlib.contextmanager
def http_limits(uri: str, timeout_s: int | None = None) -> Iterator[None]:
    """Apply `HTTP_LIMITS` around air's own calls to an http(s) server; restore afterwards.

    MLflow reads these variables at request time and has no per-client setting, so this is the only
    way to bound a call. Variables the user set are left alone. Nested and concurrent uses (sampler
    thread and supervisor) share one reference count: the last one out restores the environment.
    `timeout_s` raises the per-request timeout for this block (artifact uploads).
    """
    global _http_depth
    if not is_http(uri):
        yield
        return
    with _http_lock:
        if _http_depth == 0:
            for name, value in HTTP_LIMITS.items():
                if name not in os.environ:
                    os.environ[name] = value
                    _http_set.append(name)
        _http_depth += 1
        if timeout_s is not None and "MLFLOW_HTTP_REQUEST_TIMEOUT" in _http_set:
            os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = str(timeout_s)
    try:
        yield
    finally:
        with _http_lock:
            _http_depth -= 1
            if _http_depth == 0:
                for name in _http_set:
                    os.environ.pop(name, None)
                _http_set.clear()


# ---- the embedded store ------------------------------------------------------------------------------

_prepared: set[str] = set()
_prepare_lock = threading.Lock()


def prepare_store(uri: str) -> None:
    """Create the embedded store once per process: schema, WAL, artifact folder.

    Other URIs are left exactly as the user configured them. A file lock serialises MLflow's first-time
    schema migration across processes (two supervisors starting on a fresh AIR_HOME).
    """
    if not is_embedded(uri):
        return
    with _prepare_lock:
        if uri in _prepared:
            return
        from mlflow import MlflowClient

        root = artifact_root()
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        home = AirHome()
        db = home.mlflow_db
        with open(home.mlflow_db_lock, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                if not db.exists():
                    _create_store(db, root)
                MlflowClient(uri).search_experiments(max_results=1)  # checks the schema version
                _enable_wal(db)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
        _prepared.add(uri)


def _create_store(db: Path, root: Path) -> None:
    """Make the embedded store's file whole, then put it in place: MLflow's schema creation (tables, then
    ~60 migrations, seconds under load) runs on a private file, and `db` appears only complete (WAL set),
    so no process ever opens a half-migrated store (two migrations at once fail: "duplicate column name").
    A `db` that appeared meanwhile (made by an MLflow that took no lock) is kept as it is. The migrations
    run once per user and MLflow version: later stores start from a copy of the first (schema_template)."""
    # Created through the store class so that even MLflow's "Default" experiment keeps its artifacts
    # under AIR_HOME, not in whatever folder the caller is in.
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    draft = db.with_name(f".{db.name}.{os.getpid()}.draft")
    # A second name for a store migrated afresh after a template that did not open (MLflow keeps an engine
    # per URI, still bound to the first file).
    fallback = db.with_name(f".{db.name}.{os.getpid()}.migrated")
    try:
        for leftover in (draft, fallback):
            leftover.unlink(missing_ok=True)
        copied = _copy_template(draft)
        with _quiet_loggers("mlflow.store.db.utils", "alembic"):
            try:
                SqlAlchemyStore(f"sqlite:///{draft}", root.as_uri()).engine.dispose()
            except Exception:
                if not copied:
                    raise
                _logger.debug("the MLflow schema template %s did not open; migrating afresh", schema_template())
                copied = False
                SqlAlchemyStore(f"sqlite:///{fallback}", root.as_uri()).engine.dispose()
                os.replace(fallback, draft)
        if not copied:
            _save_template(draft)
        _enable_wal(draft)
        try:
            os.link(draft, db)  # atomic, and never over a store that exists
        except FileExistsError:
            pass
        except OSError:  # a filesystem without hard links: still atomic, under the lock
            if not db.exists():
                os.replace(draft, db)
    finally:
        for made in (draft, fallback):
            for leftover in (made, made.with_name(made.name + "-wal"), made.with_name(made.name + "-shm")):
                leftover.unlink(missing_ok=True)


def schema_template() -> Path:
    """An empty MLflow store, migrated by this MLflow version, kept per user outside every AIR_HOME
    (`$XDG_CACHE_HOME/air`, default `~/.cache/air`): a new embedded store starts as its copy instead of
    running MLflow's migrations again (~1 s of CPU each; every fresh AIR_HOME, every server's first start)."""
    from mlflow.version import VERSION

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "air" / f"mlflow-schema-{VERSION}.db"


def _copy_template(draft: Path) -> bool:
    """Start `draft` as a copy of the schema template; False when there is none this process can trust
    (absent, not a plain file, not its own account's, writable by others)."""
    try:
        template = schema_template()
        info = template.lstat()
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
            return False
        shutil.copyfile(template, draft)
        return True
    except (OSError, RuntimeError):  # RuntimeError: Path.home() of an account with no home
        draft.unlink(missing_ok=True)
        return False


def _save_template(draft: Path) -> None:
    """Keep a just-migrated store as the schema template, its Default experiment taken out (MLflow makes it
    again, under the new store's own artifact root, when it first opens a copy). Best effort: a cache that
    cannot be written only costs the next store its migrations."""
    try:
        template = schema_template()
        template.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    except (OSError, RuntimeError) as exc:  # RuntimeError: Path.home() of an account with no home
        _logger.debug("no MLflow schema template: %s", exc)
        return
    partial = template.with_name(f".{template.name}.{os.getpid()}.partial")
    try:
        shutil.copyfile(draft, partial)
        partial.chmod(0o600)
        con = sqlite3.connect(partial)
        try:
            con.execute("DELETE FROM experiments WHERE experiment_id = 0")
            con.commit()
        finally:
            con.close()
        os.replace(partial, template)
    except (OSError, sqlite3.Error) as exc:
        _logger.debug("no MLflow schema template at %s: %s", template, exc)
    finally:
        partial.unlink(missing_ok=True)


@contextlib.contextmanager
def _quiet_loggers(*names: str) -> Iterator[None]:
    """MLflow logs its schema creation at INFO on the user's stderr ("Creating initial MLflow database
    tables..."); air creates the embedded store on the user's behalf, so that is noise, not news."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def _enable_wal(db: Path) -> None:
    """Switch the embedded SQLite file to WAL (persistent): readers stop blocking rank writers."""
    try:
        con = sqlite3.connect(db, timeout=20)
        try:
            mode = con.execute("PRAGMA journal_mode").fetchone()[0]
            if str(mode).lower() != "wal":
                con.execute("PRAGMA journal_mode=WAL")
        finally:
            con.close()
    except sqlite3.Error as exc:  # an optimisation only; MLflow's busy timeout still applies
        _logger.debug("could not enable WAL on %s: %s", db, exc)


def client(uri: str) -> MlflowClient:
    """An MlflowClient bound to `uri` (never the process-wide fluent state)."""
    from mlflow import MlflowClient

    prepare_store(uri)
    return MlflowClient(uri)


def get_or_create_experiment(mlflow_client: MlflowClient, uri: str, name: str, warn: Warn) -> Experiment:
    """The experiment `name`, created (with air's artifact root when embedded) or appended to.

    Races with another process creating the same name are settled by reading it back; an experiment
    deleted in the UI is restored, since the user asked for that name again.
    """
    from mlflow.exceptions import MlflowException

    exp = mlflow_client.get_experiment_by_name(name)
    if exp is None:
        location = None
        if is_embedded(uri):
            # MLflow would default to ./mlruns under whatever folder the caller runs in.
            import uuid

            location = (artifact_root() / uuid.uuid4().hex).as_uri()
        try:
            exp_id = mlflow_client.create_experiment(
                name, artifact_location=location, tags={SHOW_LOGS_TAG: "true"}
            )
            return mlflow_client.get_experiment(exp_id)
        except MlflowException:
            exp = mlflow_client.get_experiment_by_name(name)
            if exp is None:
                raise
    if exp.lifecycle_stage == "deleted":
        warn(f"tracking: MLflow experiment {name!r} was deleted; restoring it to log this run")
        mlflow_client.restore_experiment(exp.experiment_id)
    if exp.tags.get(SHOW_LOGS_TAG) != "true":
        mlflow_client.set_experiment_tag(exp.experiment_id, SHOW_LOGS_TAG, "true")
    return exp


def os_user() -> str:
    """The OS user, recorded as `mlflow.user` like MLflow's own fluent API does."""
    import getpass

    try:
        return getpass.getuser()
    except Exception:
        return "unknown"


def tracking_enabled() -> bool:
    """AIR_TRACKING=off turns MLflow recording off for workloads and @distributed calls alike."""
    return switched(AIR_TRACKING, default=True)
