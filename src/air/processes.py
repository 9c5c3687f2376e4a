"""Every kind of process air starts, in one table (issue 36): what runs it, who starts and ends it, what it owns.

Every place in src/air that starts one builds its argv here (`PROCESS_KINDS["supervisor"].argv(run_id)`), so
a module moved or renamed breaks in one line; src/air/README.md shows the table (tests/test_processes.py keeps
both in step and finds no `-m air.` argv built elsewhere). Kept to the standard library: every layer imports it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class ProcessKind:
    """One kind of process. `module`: what `python -m` runs (for `script`, the console script's command,
    the module that holds it); `flags`: the interpreter's options before `-m`."""

    name: str
    module: str
    started_by: str
    ended_by: str
    owns: str
    script: str = ""
    flags: tuple[str, ...] = ()

    def argv(self, *args: str, python: str | None = None) -> list[str]:
        """`[python, *flags, "-m", module, *args]`; `python`: the interpreter (default: this one's)."""
        return [sys.executable if python is None else python, *self.flags, "-m", self.module, *args]


PROCESS_KINDS = {kind.name: kind for kind in (
    ProcessKind("cli", "air.cli.main", "the user",
                "itself, its command done", "nothing past its command", script="air ..."),
    ProcessKind("server", "air.cli.cmd_server", "the user (or a service manager)",
                "SIGTERM / SIGINT", "the API, the pages, the MLflow door, the admission thread", script="air server"),
    ProcessKind("ui", "air.cli.cmd_ui", "the user",
                "Ctrl-C", "its entry in ui.json, the pages, the MLflow UI (under `guard`)", script="air ui"),
    ProcessKind("admission", "air.runs.admission", "any `air` command while runs wait",
                "itself, once none waits", "the admission lock; starts admitted runs' `supervisor`"),
    ProcessKind("supervisor", "air.runs.supervisor", "admission; `air run` (a sweep's parent)",
                "itself, at the run's end", "one workload run: its attempts, nodes, supervisor.log"),
    ProcessKind("call_driver", "air.distributed.call_driver", "`air server` (a `remote=True` call)",
                "itself, at the call's end", "one call run, as a supervisor does"),
    ProcessKind("rank", "air.distributed.worker", "the node launcher (or a zygote's fork)",
                "itself; the launcher ends its tree", "one rank of a `@distributed` call"),
    ProcessKind("zygote", "air.launcher.zygote", "a warm launch",
                "the launch's end", "preloaded imports, the launch's forks, the c10d store"),
    ProcessKind("kept_zygote", "air.launcher.zygote", "a local call's caller",
                "its caller's exit", "preloaded imports kept between the caller's launches"),
    ProcessKind("guard", "air.launcher.guard", "`air server`, `air ui`",
                "its parent's end (even SIGKILL)", "a foreign process tree (MLflow's), ended whole"),
    ProcessKind("mlflow", "air.server.mlflow_app", "`guard`",
                "its guard", "MLflow's app, imported once (a socket or TCP port)"),
    ProcessKind("ended", "air.tracking.ended", "reconcile (any `air` command)",
                "itself", "ending a dead supervisor's MLflow runs"),
    ProcessKind("backfill", "air.tracking.backfill", "reconcile (any `air` command)",
                "itself", "an attempt's missing MLflow runs"),
    ProcessKind("recorder", "air.distributed.tracked", "a local call's caller",
                "itself", "the MLflow run of an attempt no rank recorded"),
    ProcessKind("sentinel", "air.backends.ray_agent", "a Ray node agent, per launch",
                "the agent's \"done\", else its death", "ending the launch's processes if the agent dies"),
    ProcessKind("slurm_node", "air.backends.slurm_node", "`srun` in a run's Slurm job, one per node",
                "its processes' end; the stop file, scancel", "one node of a Slurm attempt: its processes, node log"),
    ProcessKind("walled", "air.environments.walled", "the supervisor (`air server` runs)",
                "the build's end, a cancel", "one environment build in the run's sandbox", flags=("-I",)),
    ProcessKind("ray_shim", "air.backends.ray_shim", "a workload's `ray` command (bin/ray)",
                "itself (it execs Ray)", "free ports and marks for the node's Ray"),
)}
