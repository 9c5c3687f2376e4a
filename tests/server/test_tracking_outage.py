"""Metric logging never blocks training (issue 24): a rank logs a metric every 100 ms through a real
`air server`'s MLflow while the server (and its MLflow) is stopped for 15 s and started again; its steps go
on at the same pace and every metric is in MLflow afterwards."""

from __future__ import annotations

import json
import os
import statistics
import sys
import textwrap
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from server_helpers import AirServer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from proc_helpers import tracking_done, wait_for

#: 15 s in the suite (its time); the issue's 60 s: `OUTAGE_S=60 pytest tests/server/test_tracking_outage.py`.
OUTAGE_S = float(os.environ.get("OUTAGE_S", "15"))

RANK = """\
import os, sys, time, mlflow
out, release = sys.argv[1], sys.argv[2]
step = 0
with open(out, "a") as fh:
    while not os.path.exists(release) and step < 3000:
        began = time.time()
        mlflow.log_metric("tick", float(step), step=step)
        fh.write(f"{step} {began:.4f} {time.time() - began:.4f}\\n")
        fh.flush()
        step += 1
        time.sleep(0.1)
print("logged", step, flush=True)
"""


def _steps(path: Path) -> list[tuple[int, float, float]]:
    rows = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 3:
            rows.append((int(parts[0]), float(parts[1]), float(parts[2])))
    return rows


def _history(server: AirServer, run_id: str) -> list[float]:
    query = urllib.parse.urlencode({"run_id": run_id, "metric_key": "tick", "max_results": 25000})
    request = urllib.request.Request(f"{server.url}/mlflow/api/2.0/mlflow/metrics/get-history?{query}",
                                     headers={"Authorization": f"Bearer {server.tokens['root']}"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        return [m["value"] for m in json.loads(answer.read()).get("metrics", [])]


@pytest.mark.timeout(900)  # the server and its MLflow start twice: minutes on 2 busy cores
@pytest.mark.parametrize("server", ["mlflow"], indirect=True)
def test_log_metric_goes_on_while_the_server_is_away_and_every_metric_lands(server: AirServer,
                                                                            tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    steps, release = tmp_path / "steps.txt", tmp_path / "release"
    spec = tmp_path / "ticker.yaml"
    spec.write_text(textwrap.dedent(f"""\
        experiment_name: away
        compute: {{num_accelerators: 1, accelerator_type: CPU_1xCPU}}
        command: {sys.executable} {script} {steps} {release}
    """))
    run_id = server.air_json("alice", "run", "-f", str(spec))["run_id"]
    wait_for(lambda: steps.exists() and len(_steps(steps)) >= 30, "30 steps logged with the server up", timeout=300)

    server.stop()
    down_at = time.time()
    time.sleep(OUTAGE_S)
    up_at = time.time()
    server.start()
    wait_for(lambda: len([s for s in _steps(steps) if s[1] > time.time() - 5]) >= 20,
             "steps going on after the restart", timeout=120)
    release.touch()
    assert server.wait_status(run_id, "SUCCESS", timeout=600) == "SUCCESS"

    rows = _steps(steps)
    before = [b for _, b, _ in rows if b < down_at]
    during = [(b, d) for _, b, d in rows if down_at + 1 <= b <= up_at]
    gaps_before = [b - a for a, b in zip(before[-30:], before[-29:], strict=False)]
    gaps_during = [b - a for (a, _), (b, _) in zip(during, during[1:], strict=False)]
    assert len(during) >= 20, f"only {len(during)} steps in the {OUTAGE_S:g} s the server was away"
    rate_drop = 1 - statistics.median(gaps_before) / statistics.median(gaps_during)
    assert rate_drop < 0.10, (f"step rate dropped {rate_drop:.0%} while the server was away "
                              f"(median step {statistics.median(gaps_before):.3f} s -> "
                              f"{statistics.median(gaps_during):.3f} s)")
    assert max(d for _, d in during) < 5.0, "a log_metric call blocked while the server was away"

    tracking_done(run_id, home=server.home)  # (an ended run's MLflow id is recorded just after its end)
    mlflow_run = server.air_json("alice", "get", "run", run_id)["mlflow_run_id"]
    logged = sorted(_history(server, mlflow_run))
    assert logged == [float(s) for s, _, _ in rows], f"{len(logged)} of {len(rows)} metrics in MLflow"
