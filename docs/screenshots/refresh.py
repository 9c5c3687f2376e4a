"""Retake the pictures of air's pages in docs/screenshots/ from real runs: `.venv/bin/python docs/screenshots/refresh.py`.

Why a script and not the tests: the pictures should show what a team sees (a small model training with loss
and accuracy charts, a failed run's reason, a live run), not a test's one-second fixtures. It makes a
throwaway AIR_HOME, submits three real workloads through the `air` CLI (a tiny torch MLP on CPU logging
MLflow metrics per step): one that succeeds, one that fails with a reason, one still running; serves the
pages as `air ui` does; photographs them with Debian's headless chromium (Selenium); then cancels the
running run, stops every process it started and removes the AIR_HOME. Takes a few minutes on a loaded machine.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
WIDTH, HEIGHT = 1400, 1000
#: Runs start slowly on a loaded 2-core machine (torch and mlflow imports): generous deadlines.
DEADLINE_S = 600
#: A run's terminal statuses (air.store.states.RunStatus).
ENDED = ("SUCCESS", "FAILED", "CANCELED")

#: The training each workload runs: a small MLP on two interleaved spirals, one MLflow point per step.
TRAIN_PY = '''\
"""A small MLP on two spirals (CPU); loss and accuracy go to MLflow at every step."""
import math, os, sys, time
import torch
import yaml

params = {"steps": 40, "lr": 0.05, "hidden": 64, "fail_at": -1, "pause_s": 0.25}
if os.environ.get("HYPERPARAMETERS_PATH"):
    params.update(yaml.safe_load(open(os.environ["HYPERPARAMETERS_PATH"])) or {})
node = int(os.environ.get("NODE_RANK", "0"))
mlflow = None
if node == 0 and os.environ.get("MLFLOW_RUN_ID"):
    import mlflow  # air sets MLFLOW_RUN_ID and MLFLOW_TRACKING_URI

torch.manual_seed(0)
n = 1024
t = torch.linspace(0.5, 3 * math.pi, n // 2)
arm = torch.stack([t * torch.cos(t), t * torch.sin(t)], 1) / 10
x = torch.cat([arm, -arm]) + 0.03 * torch.randn(n, 2)
y = torch.cat([torch.zeros(n // 2), torch.ones(n // 2)]).long()
h = int(params["hidden"])
model = torch.nn.Sequential(torch.nn.Linear(2, h), torch.nn.Tanh(), torch.nn.Linear(h, h), torch.nn.Tanh(),
                            torch.nn.Linear(h, 2))
opt = torch.optim.Adam(model.parameters(), lr=float(params["lr"]))
steps = int(params["steps"])
sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(steps, 1))
print(f"node {node}: training a {h}-wide MLP on {n} points for {steps} steps, lr {params['lr']}", flush=True)
step = 0
while step < steps:
    opt.zero_grad()
    out = model(x)
    loss = torch.nn.functional.cross_entropy(out, y)
    if step == int(params["fail_at"]):
        loss = loss * float("nan")
    if not torch.isfinite(loss):
        raise FloatingPointError(f"loss is {loss.item()} at step {step}: lower the learning rate ({params['lr']})")
    loss.backward()
    opt.step()
    sched.step()
    acc = (out.argmax(1) == y).float().mean().item()
    print(f"node {node} step {step:3d}  loss {loss.item():.4f}  accuracy {acc:.3f}", flush=True)
    if mlflow is not None:
        mlflow.log_metrics({"loss": loss.item(), "accuracy": acc}, step=step)
    step += 1
    time.sleep(float(params["pause_s"]))
print(f"node {node}: done after {step} steps", flush=True)
'''


def workload(name: str, nodes: int, params: dict[str, Any]) -> str:
    """A workload YAML for TRAIN_PY, with `params` as its parameters."""
    return textwrap.dedent(f"""\
        experiment_name: {name}
        compute: {{num_accelerators: {nodes}, accelerator_type: CPU_1xCPU}}
        code_source:
          type: snapshot
          snapshot: {{root_path: .}}
        max_retries: 0
        timeout_minutes: 30
        parameters: {json.dumps(params)}
        command: |
          cd "$CODE_SOURCE_PATH"
          python train.py
        """)


class Air:
    """The `air` CLI over one AIR_HOME, as a user runs it."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env

    def __call__(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        result = subprocess.run([sys.executable, "-m", "air.cli.main", *args], capture_output=True, text=True,
                                env=self.env, timeout=timeout)
        if result.returncode not in (0, 1):
            raise RuntimeError(f"air {' '.join(args)} exited {result.returncode}:\n{result.stderr}{result.stdout}")
        return result

    def submit(self, path: Path) -> str:
        return str(json.loads(self("run", "-f", str(path), "--json").stdout)["data"]["run_id"])

    def run(self, run_id: str) -> dict[str, Any]:
        return dict(json.loads(self("get", "run", run_id, "--json").stdout)["data"])


def wait_for(check: Callable[[], Any], what: str, timeout: float = DEADLINE_S, interval: float = 1.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"gave up waiting {timeout:.0f}s for {what}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def chromium() -> Iterator[Any]:
    """Debian's headless chromium through its chromedriver, with the flags that work in a container."""
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="air-chromium-")
    options = Options()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--hide-scrollbars", f"--window-size={WIDTH},{HEIGHT}", f"--user-data-dir={profile}"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(120)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


@contextmanager
def pages(home: Path) -> Iterator[str]:
    """air's pages over `home`, served in this process as `air ui` serves them; stopped afterwards."""
    from air.web import create_web_app
    from air.web.serve import PageServer

    port = free_port()
    server = PageServer(create_web_app(), "127.0.0.1", port)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


def shoot(driver: Any, url: str, name: str, ready: str, full_height: int = HEIGHT) -> None:
    """Open `url`, wait until the JavaScript expression `ready` holds, save docs/screenshots/`name`.
    `full_height` > HEIGHT grows the window to show up to that much of a long page."""
    driver.set_window_size(WIDTH, HEIGHT)
    driver.get(url)
    wait_for(lambda: driver.execute_script(f"return Boolean({ready});"), f"{name}: {ready}", interval=0.5)
    if full_height > HEIGHT:
        # set_window_size sets the outer window: add the browser's chrome so the page gets the height wanted.
        page = int(driver.execute_script("return document.documentElement.scrollHeight;"))
        chrome = int(driver.execute_script("return window.outerHeight - window.innerHeight;"))
        driver.set_window_size(WIDTH, min(max(page, HEIGHT), full_height) + chrome)
        time.sleep(1)
    driver.execute_script("window.scrollTo(0, 0);")
    time.sleep(1)  # the log box scrolls to its end and charts draw after load
    assert driver.save_screenshot(str(HERE / name)), f"could not save {name}"
    print(f"  wrote {HERE / name}")


def leftover_processes(home: Path) -> list[Any]:
    """Every process whose environment names this AIR_HOME (the runs' supervisors, nodes and their children)."""
    import psutil

    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid != os.getpid() and proc.environ().get("AIR_HOME") == str(home):
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def main() -> int:
    started = time.monotonic()
    for binary in (CHROMIUM, CHROMEDRIVER):
        if not binary.exists():
            print(f"{binary} is missing: apt-get install chromium chromium-driver", file=sys.stderr)
            return 2
    root = Path(tempfile.mkdtemp(prefix="air-screenshots-"))
    home, code = root / "air-home", root / "spirals"
    code.mkdir()
    (code / "train.py").write_text(TRAIN_PY)
    specs = {
        "baseline": workload("spirals-mlp", 1, {"steps": 40, "lr": 0.05, "hidden": 64}),
        "diverges": workload("spirals-mlp-lr-sweep", 1, {"steps": 40, "lr": 5.0, "hidden": 64, "fail_at": 23}),
        "long": workload("spirals-mlp-wide", 2, {"steps": 5000, "lr": 0.02, "hidden": 256, "pause_s": 0.5}),
    }
    for name, text in specs.items():
        (code / f"{name}.yaml").write_text(text)
    # The workloads' `python` is this one (torch, mlflow), as in an activated venv.
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {**os.environ, "AIR_HOME": str(home), "AIR_CPU_SLOTS": "8", "PATH": path}
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_ID", "MLFLOW_EXPERIMENT_NAME",
                "AIR_PROFILE", "AIR_SERVER_URL", "AIR_TOKEN", "AIR_TRACKING"):
        env.pop(var, None)
    os.environ.clear()
    os.environ.update(env)  # the pages served in this process read the same AIR_HOME
    air = Air(env)
    long_run = ""
    try:
        print(f"AIR_HOME={home}")
        done = air.submit(code / "baseline.yaml")
        failed = air.submit(code / "diverges.yaml")
        wait_for(lambda: all(air.run(r)["status"] in ENDED for r in (done, failed)), f"{done} and {failed} to end")
        print(f"  {done}: {air.run(done)['status']}; {failed}: {air.run(failed)['status']}, "
              f"{air.run(failed).get('termination_reason')}")
        long_run = air.submit(code / "long.yaml")
        wait_for(lambda: air.run(long_run)["status"] == "RUNNING", f"{long_run} to run")
        wait_for(lambda: "step  30" in air("logs", long_run, "--no-follow").stdout, f"{long_run} at step 30",
                 interval=3)
        with pages(home) as base, chromium() as driver:
            shoot(driver, f"{base}/runs", "runs.png",
                  "document.querySelectorAll('#runs-table tbody tr').length === 3")
            charts = "document.querySelectorAll('svg.chart').length > 0"
            shoot(driver, f"{base}/runs/{long_run}", "run.png",
                  f"{charts} && document.querySelector('#log') && document.querySelector('#log').innerText.includes('step')",
                  full_height=2000)
            shoot(driver, f"{base}/runs/{failed}", "run-failed.png", charts, full_height=2000)
            shoot(driver, f"{base}/capacity", "capacity.png", "document.body.innerText.includes('CPU')")
    finally:
        if long_run:
            air("cancel", long_run)
            wait_for(lambda: air.run(long_run)["status"] in ENDED, f"{long_run} to end", timeout=300)
        left = leftover_processes(home)
        deadline = time.monotonic() + 60
        while left and time.monotonic() < deadline:
            time.sleep(1)
            left = leftover_processes(home)
        for proc in left:  # none expected: air ends a run's processes with it
            print(f"  ending leftover process {proc.pid}: {' '.join(proc.cmdline())[:120]}", file=sys.stderr)
            proc.kill()
        shutil.rmtree(root, ignore_errors=True)
    print(f"done in {time.monotonic() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
