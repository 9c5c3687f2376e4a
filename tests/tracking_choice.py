"""Which tests' runs record to MLflow. A run's supervisor spends ~2 s more CPU when it does (MLflow's import
and its store): the suite, CPU-bound on 2 cores, keeps tracking for the tests about it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

#: Folders whose tests keep the product's tracking default for every run: tracking is their subject. (A
#: server a fixture shares between tests says whether its runs track itself: tests/server/server_helpers.py.)
TRACKING_FOLDERS = frozenset({"tracking", "tracking_runs", "quickstart", "lean"})


def tracks(request: pytest.FixtureRequest) -> bool:
    """Do the runs of the requesting test module record to MLflow (by its folder, or it names MLflow or
    tracking)? A module-scoped fixture asks with its own request: it is set up before `air_home`."""
    module_path = Path(str(request.node.path))
    folder = module_path.parent.name if module_path.parent.name != "tests" else ""
    return folder in TRACKING_FOLDERS or _names_tracking(module_path)


def _names_tracking(path: Path) -> bool:
    """Does this test module name MLflow or tracking anywhere (a test of what a run records there, or of a
    secret kept out of it)? Read once per module."""
    named = _TRACKING_NAMED.get(path)
    if named is None:
        # A line that turns tracking off for a test (and its comment) does not make a module need it on.
        text = "\n".join(line for line in path.read_text(errors="replace").lower().splitlines()
                         if not any(turned_off in line for turned_off in TURNED_OFF))
        named = _TRACKING_NAMED[path] = "mlflow" in text or "tracking" in text
    return named


_TRACKING_NAMED: dict[Path, bool] = {}
#: How a test turns tracking off for its own runs (lower case).
TURNED_OFF = ('setenv("air_tracking", "off")', '"air_tracking": "off"')
