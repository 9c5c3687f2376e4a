"""`air ui`: MLflow's own UI over air's tracking store, on localhost."""

from __future__ import annotations

import os
import subprocess

import click

from air.cli.main import common
from air.cli.output import stderr


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=5000, show_default=True, type=click.IntRange(1, 65535))
@common
def ui(host: str, port: int) -> int:
    """Start the MLflow UI for air's tracking store and print its address (Ctrl-C stops it)."""
    from air.tracking import tracking_uri, ui_command

    argv = ui_command(host=host, port=port)
    stderr(f"MLflow UI for {tracking_uri()} at http://{host}:{port}  (Ctrl-C to stop)")
    proc = subprocess.Popen(argv, env=dict(os.environ))
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        proc.wait(timeout=10)
        return 0
