"""Serve the pages with uvicorn on a thread of the calling process (`air ui`), so they end with it however
it ends (a SIGKILL included: no separate process to leave behind)."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from air.constants import WEB_SHUTDOWN_GRACE_S
from air.errors import LaunchError

if TYPE_CHECKING:
    from starlette.applications import Starlette


class PageServer:
    """uvicorn serving `app` on host:port from a daemon thread; `stop()` ends it (open live streams get
    WEB_SHUTDOWN_GRACE_S)."""

    def __init__(self, app: Starlette, host: str, port: int) -> None:
        import uvicorn

        config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                timeout_graceful_shutdown=int(max(1, WEB_SHUTDOWN_GRACE_S)), lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="air-web", daemon=True)

    def start(self, timeout_s: float = 30.0) -> None:
        """Start and wait until it listens; LaunchError when it could not (the port was taken meanwhile)."""
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise LaunchError(
                    f"air's pages could not listen on {self.server.config.host}:{self.server.config.port}.",
                    hint="Pick another port with --web-port (the port may have been taken meanwhile).",
                )
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=WEB_SHUTDOWN_GRACE_S + 5)

