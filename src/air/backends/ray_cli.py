"""Ray's own `ray` command, with one thing Ray's `ray start` leaves out: it tells the raylet the
dashboard agent's listen port that it was given.

Why: the raylet learns each agent port it was not told from a file the agent writes once it has loaded
its modules and started its HTTP server, and it aborts when that file has not appeared within a fixed
15 s ("Timed out waiting for file .../dashboard_agent_listen_port_...", NodeManager::WaitForDashboardAgentPorts;
no setting changes that wait in Ray 2.60). `ray start --dashboard-agent-listen-port=P` passes P to the
agent but not to the raylet, so even a node whose every port air chose waits on that file, and on a busy
machine the whole start fails ("The current node timed out during startup"). Told the port, the raylet
waits on nothing: measured on 2 cores beside 12 busy loops, each in a session of its own, a head with the
plain `ray start` failed all three tries twice in a row (about 300 s each time); with this command it came
up on its first try three times (73-82 s) and ran a task.

The flag is added only when the port was given and the raylet has the flag (older Rays have neither the
flag nor the wait). For `ray start` the CLI also leaves out the commands it never runs there (Serve, jobs,
state: OTHER_COMMANDS), as Ray's CLI does where they cannot be imported: 3.3 s of CPU for each node started
becomes 0.9 s. Everything else is Ray's CLI, unchanged.

This file imports nothing of air: it runs as a script (`python ray_cli.py start ...`) under whatever
interpreter has Ray, also a user's environment that lacks air (the workload `ray` shim runs the user's
own Ray through it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

#: The `ray start` option that names the dashboard agent's listen port, and the raylet flag that takes it.
START_OPTION = "--dashboard-agent-listen-port"
RAYLET_FLAG = "--dashboard_agent_listen_port"


def given_listen_port(args: Sequence[str]) -> int | None:
    """The dashboard agent listen port a `ray start` command line gives (either spelling), if any."""
    for index, arg in enumerate(args):
        value: str | None = None
        if arg.startswith(START_OPTION + "="):
            value = arg.partition("=")[2]
        elif arg == START_OPTION and index + 1 < len(args):
            value = args[index + 1]
        if value is not None and value.isdigit() and int(value) > 0:
            return int(value)
    return None


def raylet_knows_flag(raylet: str) -> bool:
    """Whether this Ray's raylet takes RAYLET_FLAG (gflags lists main.cc's flags for --helpon=main)."""
    try:
        shown = subprocess.run([raylet, "--helpon=main"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return False
    return RAYLET_FLAG.lstrip("-") in shown.stdout + shown.stderr


def tell_raylet_the_listen_port(port: int) -> None:
    """Have Ray's process launcher add RAYLET_FLAG=port to the raylet's command line."""
    from ray._private import ray_constants, services

    launch = services.start_ray_process
    checked: dict[str, bool] = {}

    def start_ray_process(command: list[str], process_type: str, *args: Any, **kwargs: Any) -> Any:
        if (process_type == ray_constants.PROCESS_TYPE_RAYLET and command
                and not any(str(part).startswith(RAYLET_FLAG) for part in command)):
            raylet = str(command[0])
            if raylet not in checked:
                checked[raylet] = raylet_knows_flag(raylet)
            if checked[raylet]:
                command = [*command, f"{RAYLET_FLAG}={port}"]
        return launch(command, process_type, *args, **kwargs)

    services.start_ray_process = start_ray_process


#: The modules Ray's CLI imports only to add its `serve`, `job` and state (`list`, `get`, `summary`, `logs`)
#: commands, each in a `try` that leaves the command out when the import fails (as in a minimal install).
OTHER_COMMANDS = ("ray.serve.scripts", "ray.dashboard.modules.job.cli", "ray.util.state.state_cli")


def leave_out_other_commands() -> None:
    """Make the imports of OTHER_COMMANDS fail, as Ray's CLI allows: `ray start` uses none of them, and they
    cost it 2.4 of its 3.3 s of CPU (pandas, FastAPI and Ray's job SDK), paid again by every node started."""
    for name in OTHER_COMMANDS:
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]  # None in sys.modules: ImportError


def main() -> None:
    if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]  # run as a script: this folder's modules must not shadow installed ones
    args = sys.argv[1:]
    if args[:1] == ["start"]:
        leave_out_other_commands()
        port = given_listen_port(args)
        if port is not None:
            tell_raylet_the_listen_port(port)
    from ray.scripts.scripts import main as ray_main

    sys.argv = ["ray", *args]
    sys.exit(ray_main())


if __name__ == "__main__":
    main()
