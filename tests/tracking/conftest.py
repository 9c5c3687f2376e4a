"""One real embedded MLflow store for all tracking tests.

Creating an MLflow SQLite store runs its whole schema migration (seconds on a busy machine), so the
tracking tests share one AIR_HOME for the session instead of the root conftest's fresh one per test.
Environment changes stay function-scoped (`monkeypatch`), so nothing leaks into other test folders.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

#: MLflow variables a developer's shell might carry; tests start from none of them.
MLFLOW_VARS = (
    "MLFLOW_TRACKING_URI",
    "MLFLOW_RUN_ID",
    "MLFLOW_EXPERIMENT_ID",
    "MLFLOW_EXPERIMENT_NAME",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES",
    "MLFLOW_HTTP_REQUEST_TIMEOUT",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR",
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER",
)


@pytest.fixture(scope="session")
def shared_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tracking-air-home")


@pytest.fixture(autouse=True)
def air_home(shared_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Overrides the root fixture: the shared AIR_HOME, and no MLflow variables from the shell."""
    monkeypatch.setenv("AIR_HOME", str(shared_home))
    monkeypatch.chdir(tmp_path)  # MLflow's ./mlruns default and anything else lands here, not in the repo
    for name in MLFLOW_VARS:
        monkeypatch.delenv(name, raising=False)
    return shared_home


@pytest.fixture(scope="module")
def module_env(shared_home: Path) -> Iterator[None]:
    """The same environment for module-scoped fixtures (which cannot use `monkeypatch`)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AIR_HOME", str(shared_home))
        for name in MLFLOW_VARS:
            mp.delenv(name, raising=False)
        yield
