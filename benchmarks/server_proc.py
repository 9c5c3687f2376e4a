"""A real `air server` on loopback for the benchmark scripts: its own AIR_HOME, a token, a client
environment that talks to it, and a clean stop (one copy instead of one per benchmark)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

AIR = [sys.executable, "-m", "air.cli.main"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class BenchServer:
    """`air server start` with `args` (e.g. `--single-trust-domain`), started and ready on return.

    `env`: extra variables of the server's process (e.g. AIR_CPU_SLOTS). `admin`: whether the token is an
    admin's. `mlflow`: run the server's MLflow and wait until it answers. `health` is the health answer
    that said ready; `client_env` is a client's environment (AIR_SERVER_URL, AIR_TOKEN, its own AIR_HOME)."""

    def __init__(self, home: Path, *args: str, env: Mapping[str, str] | None = None, admin: bool = True,
                 mlflow: bool = False, ready_s: float = 180.0) -> None:
        home.mkdir(parents=True, exist_ok=True)
        self.home, self.port = home, free_port()
        base = {k: v for k, v in os.environ.items() if k not in ("AIR_SERVER_URL", "AIR_TOKEN")}
        self.env = {**base, "AIR_HOME": str(home), **(env or {})}
        create = [*AIR, "server", "token", "create", "bench", *(["--admin"] if admin else [])]
        self.token = subprocess.run(create, env=self.env, check=True, capture_output=True,
                                    text=True).stdout.strip().splitlines()[-1]
        self.client_env = {**base, "AIR_SERVER_URL": self.url, "AIR_TOKEN": self.token,
                           "AIR_HOME": str(home.parent / f"client-{home.name}")}
        self.proc = subprocess.Popen(
            [*AIR, "server", "start", "--port", str(self.port), "--mlflow-port", str(free_port()) if mlflow else "0",
             *args], env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.health = self._ready(ready_s, mlflow)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _ready(self, within_s: float, mlflow: bool) -> dict[str, Any]:
        deadline = time.monotonic() + within_s
        while True:
            try:
                with urllib.request.urlopen(self.url + "/api/v1/health", timeout=2) as answer:
                    health: dict[str, Any] = json.loads(answer.read())
                if not mlflow or health.get("mlflow", {}).get("state", "off") in ("ready", "off"):
                    return health
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"air server exited with {self.proc.returncode} before it was ready")
            if time.monotonic() > deadline:
                raise TimeoutError(f"air server not ready within {within_s:g} s")
            time.sleep(0.1)

    def request(self, method: str, path: str, body: Any = None) -> Any:
        """One API call as the token's user (`path` under /api/v1); the decoded answer."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + "/api/v1" + path, data=data, method=method,
                                     headers={"Authorization": f"Bearer {self.token}",
                                              "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as answer:
            return json.loads(answer.read())

    def stop(self, timeout: float = 120.0) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=timeout)
