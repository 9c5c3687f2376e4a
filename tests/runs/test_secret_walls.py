"""Secrets never appear (issue 22): a run's secret values are masked where its lines are written, so no file
under AIR_HOME holds one — node logs, supervisor.log, the termination reason in the store, MLflow's tags
and log artifacts — whatever the line length; reads and downloads mask again for logs an older air wrote."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest

from air.launcher.pump import MAX_LINE, OutputPump
from air.launcher.redact import Redactor
from air.store.paths import RunPaths
from air.store.run_store import RunStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workload_runs"))
from runs_helpers import air, wait_terminal, write_workload

from proc_helpers import pipe_unread, tracking_done, wait_for
from secret_leaks import LEAKY_PROGRAM, LEAKY_REASON

KIB = 1024


def distinctive_secret() -> str:
    return f"AIRLEAK{uuid.uuid4().hex[:16]}Z"


# ---- the rules, in memory ----------------------------------------------------------------------------


def test_a_piece_never_ends_inside_a_value_whatever_the_chunking() -> None:
    """Feeding a long line through `Redactor.split` in random chunks gives exactly the masked line: every
    value is masked, also those that start in one piece and end in the next, and nothing else changes."""
    secret, other = "s3cr3t-VALUE-0123456789", "tok"
    redactor = Redactor([secret, other])
    rng = random.Random(22)
    for _ in range(300):
        parts = [rng.choice([b"x" * rng.randint(0, 40), secret.encode(), other.encode(), b"s3cr3t-VAL"])
                 for _ in range(rng.randint(1, 30))]
        data = b"".join(parts)
        written, buf, pos = b"", b"", 0
        while pos < len(data):
            step = rng.randint(1, 50)
            buf += data[pos:pos + step]
            pos += step
            piece, buf = redactor.split(buf)
            written += piece
        written += redactor.mask_bytes(buf)
        assert written == redactor.mask_bytes(data), data


def test_mask_rules_are_shared_by_text_bytes_and_multi_line_values() -> None:
    pem = "-----BEGIN KEY-----\nAAAAsecretline1\nBBBBsecretline2\n-----END KEY-----"
    redactor = Redactor([pem, "ab", "abc"])
    assert redactor.mask_text("xabcx ab") == "x***x ***"  # the longer value is hidden whole
    assert redactor.mask_text("key: BBBBsecretline2\r") == "key: ***\r"
    assert redactor.mask_bytes("é abc".encode()) == "é ***".encode()
    assert not Redactor([]) and Redactor([]).mask_text("abc") == "abc" and Redactor([""]).overlap == 0


# ---- the pump, with a real pipe ------------------------------------------------------------------------


def test_the_pump_masks_a_value_that_straddles_a_64_kib_piece(tmp_path: Path) -> None:
    """A 200 KiB line arrives in writes that end inside a value, at and around each 64 KiB piece boundary;
    the pump writes each piece before the rest arrives (waited for, not slept on). The log, pieces joined,
    is the line with every value masked; nothing of a value is written, not even half of one."""
    secret = distinctive_secret()
    s = secret.encode()
    size = 200 * KIB
    offsets = [0, MAX_LINE - 5, 2 * MAX_LINE - len(s) + 3, 3 * MAX_LINE - 1, size - len(s)]
    line = bytearray(b"." * size)
    for off in offsets:
        line[off:off + len(s)] = s
    line_bytes = bytes(line)
    cuts = [MAX_LINE, 2 * MAX_LINE, 3 * MAX_LINE, size]  # each write ends inside (or at) a value
    log_path = tmp_path / "node.log"
    lines: list[str] = []
    read_fd, write_fd = os.pipe()
    with open(log_path, "ab", buffering=0) as log, os.fdopen(read_fd, "rb", buffering=0) as pipe:
        pump = OutputPump(lambda _i, _s, text: lines.append(text))
        pump.add(0, "stdout", pipe, log, Redactor([secret]))
        pump.start()
        start = 0
        for cut in cuts:
            view = memoryview(line_bytes)[start:cut]
            writer = threading.Thread(target=lambda v=view: os.write(write_fd, v))  # a full pipe blocks
            before = log_path.stat().st_size
            writer.start()
            wait_for(lambda w=writer: pipe_unread(read_fd) == 0 and not w.is_alive(), "the pump to read the write",
                     timeout=60, interval=0.01)
            if cut - start >= MAX_LINE:  # a whole piece more: written before the next write comes
                wait_for(lambda b=before: log_path.stat().st_size > b, "the pump to write the piece",
                         timeout=60, interval=0.01)
            writer.join()
            start = cut
        os.write(write_fd, b"\nthe end\n")
        os.close(write_fd)
        assert pump.join(timeout=60)
    written = log_path.read_bytes()
    assert secret.encode() not in written and secret[:8].encode() not in written
    pieces, end = written.rsplit(b"\n", 2)[0], written.rsplit(b"\n", 2)[1]
    assert pieces.replace(b"\n", b"") == line_bytes.replace(s, b"***") and end == b"the end"
    # Written in pieces before the rest arrived (waited for above), and stored as one line (issue 25: the
    # log no longer cuts a long line every MAX_LINE bytes; readers bound what they show of it).
    assert written.count(b"\n") == 2
    assert "".join(lines[:-1]) == line_bytes.replace(s, b"***").decode() and secret not in "".join(lines)


# ---- a real run, through the real CLI ------------------------------------------------------------------




def leaky_workload(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "leak.py").write_text(LEAKY_PROGRAM)
    return write_workload(folder, "leaky", f"""
        experiment_name: secret-walls
        compute: {{num_accelerators: 1, accelerator_type: CPU_1xCPU}}
        max_retries: 0
        secrets: {{API_TOKEN: team/token}}
        command: python {folder / 'leak.py'}
    """)


def grep_home(home: Path, needle: str) -> list[str]:
    """Every file under `home` holding `needle` (grep -a -r -l, as a tester would look)."""
    found = subprocess.run(["grep", "-a", "-r", "-l", needle, str(home)], capture_output=True, text=True)
    assert found.returncode in (0, 1), found.stderr
    return sorted(found.stdout.split())


def test_a_leaky_run_leaves_its_secret_nowhere_but_the_store(tmp_path: Path, air_home: Path) -> None:
    """The workload prints its secret in a 200 KiB line (across the 64 KiB piece boundaries) and in its
    last error line, and exits 1; its node log goes to MLflow as an artifact. Afterwards only the secret
    store holds the value; the reason, `air get`, `--json`, `air logs`, `--download-to` and `--watch` show ***."""
    secret = distinctive_secret()
    assert air("secrets", "put", "team", "token", input=secret + "\n").returncode == 0
    watched = air("run", "-f", str(leaky_workload(tmp_path / "code")), "--watch", "--json", timeout=300)
    assert watched.returncode == 1, watched.stderr
    assert secret not in watched.stdout + watched.stderr
    events = [json.loads(line) for line in watched.stdout.splitlines()]
    run_id = events[0]["run_id"]
    assert events[-1]["type"] == "TERMINAL" and events[-1]["status"] == "FAILED"
    assert "ERROR: login refused for token ***" in events[-1]["reason"]
    assert any("starting with token ***" == e.get("line") for e in events)
    run = wait_terminal(run_id)
    tracking_done(run_id)  # its MLflow run is recorded and ended (node log uploaded) just after the run's end
    assert run.termination_reason == LEAKY_REASON
    attempts = RunStore().list_attempts(run_id)
    assert attempts and all(secret not in (a.termination_reason or "") for a in attempts)

    assert grep_home(air_home, secret) == [str(air_home / "secrets.json")]
    assert grep_home(air_home, secret[:12]) == [str(air_home / "secrets.json")]  # not half of one either
    node_log = RunPaths(run_id).node_log(0, 0)
    assert node_log.read_bytes().count(b"***") >= 7  # 5 in the long line, the first line, the last
    artifact = _mlflow_node_log_and_reason(run_id, tmp_path / "artifact")
    assert artifact == node_log.read_bytes() and b"login refused for token ***" in artifact

    shown = air("get", "run", run_id)
    assert shown.returncode == 0 and "login refused for token ***" in shown.stdout and secret not in shown.stdout
    as_json = air("get", "run", run_id, "--json")
    assert "login refused for token ***" in as_json.stdout and secret not in as_json.stdout
    logs = air("logs", run_id)
    assert logs.returncode == 0 and "ERROR: login refused for token ***" in logs.stdout
    assert secret not in logs.stdout + logs.stderr
    logs_json = air("logs", run_id, "--json")
    assert logs_json.returncode == 0 and secret not in logs_json.stdout and "***" in logs_json.stdout
    copied = air("logs", run_id, "--download-to", str(tmp_path / "dl"))
    assert copied.returncode == 0, copied.stderr
    downloaded = (tmp_path / "dl" / "logs" / "node_0.log").read_bytes()
    assert downloaded == node_log.read_bytes() and secret.encode() not in downloaded


def _mlflow_node_log_and_reason(run_id: str, into: Path) -> bytes:
    """Through MLflow's own client: the tag `air.termination_reason` is masked; the node log artifact."""
    from mlflow.tracking import MlflowClient

    from air.tracking.store import embedded_uri

    attempt = RunStore().list_attempts(run_id)[-1]
    assert attempt.mlflow_run_id
    client = MlflowClient(embedded_uri())
    tags = client.get_run(attempt.mlflow_run_id).data.tags
    assert tags["air.termination_reason"] == LEAKY_REASON
    into.mkdir()
    return Path(client.download_artifacts(attempt.mlflow_run_id, "logs/attempt_0/node_0.log", str(into))).read_bytes()


def test_reads_and_downloads_mask_logs_an_older_air_wrote(tmp_path: Path, air_home: Path) -> None:
    """A node log written raw (before masking at write) is still masked by `air logs` and by a local
    `--download-to`; when the secret can no longer be resolved, both refuse (exit 1) and copy nothing."""
    secret = distinctive_secret()
    assert air("secrets", "put", "team", "old", input=secret + "\n").returncode == 0
    path = write_workload(tmp_path, "old", """
        experiment_name: old-logs
        compute: {num_accelerators: 1, accelerator_type: CPU_1xCPU}
        secrets: {API_TOKEN: team/old}
        command: echo "token is $API_TOKEN"
    """)
    submitted = air("run", "-f", str(path), "--json")
    assert submitted.returncode == 0, submitted.stderr
    run_id = json.loads(submitted.stdout)["data"]["run_id"]
    assert wait_terminal(run_id).status.value == "SUCCESS"
    node_log = RunPaths(run_id).node_log(0, 0)
    assert "token is ***" in node_log.read_text() and secret not in node_log.read_text()
    with open(node_log, "ab") as fh:  # what an older air left behind
        fh.write(f"old line with {secret} in it\n".encode() + b"bad utf-8 \xff kept\n")
    copied = air("logs", run_id, "--download-to", str(tmp_path / "dl"))
    assert copied.returncode == 0, copied.stderr
    downloaded = (tmp_path / "dl" / "logs" / "node_0.log").read_bytes()
    assert b"old line with *** in it\n" in downloaded and secret.encode() not in downloaded
    assert downloaded.endswith(b"bad utf-8 \xff kept\n")  # otherwise byte for byte
    assert air("secrets", "delete", "team", "old").returncode == 0
    refused = air("logs", run_id, "--download-to", str(tmp_path / "dl2"))
    assert refused.returncode == 1 and "air secrets put team old" in refused.stdout + refused.stderr
    assert not (tmp_path / "dl2").exists() and secret not in refused.stdout + refused.stderr


@pytest.mark.parametrize("hide", [True, False])
def test_the_launcher_masks_only_the_processes_given_secrets(tmp_path: Path, hide: bool) -> None:
    """`ProcessSpec.hide` is what turns masking on: the same output is kept as printed without it."""
    from air.launcher import ProcessSpec, start_processes

    secret = distinctive_secret()
    spec = ProcessSpec("node 0", [sys.executable, "-c", f"print('v={secret}')"], dict(os.environ),
                       tmp_path / "p.log", hide=(secret,) if hide else ())
    launch = start_processes([spec])
    assert launch.wait(timeout=120).ok
    assert (tmp_path / "p.log").read_text() == ("v=***\n" if hide else f"v={secret}\n")


@pytest.mark.ray
def test_ray_nodes_mask_where_they_write(ray_cluster: Any, air_home: Path, tmp_path: Path) -> None:
    """On the ray profile each node's agent writes the node's lines on its Ray node (proc_N.log) and
    sends them to the supervisor, which writes the node log: both are masked while the run still runs
    (read then, as the agent's folder goes with the run), and at the end only the store holds the value."""
    from air.backends.base import node_work_root

    secret = distinctive_secret()
    assert air("secrets", "put", "team", "ray", input=secret + "\n").returncode == 0
    ray_cluster.write_profile(air_home)
    release = tmp_path / "release"
    path = write_workload(tmp_path, "ray-leaky", f"""
        experiment_name: ray-secret-walls
        compute: {{num_accelerators: 2, accelerator_type: CPU_1xCPU}}
        max_retries: 0
        secrets: {{API_TOKEN: team/ray}}
        command: |
          echo "node $NODE_RANK token is $API_TOKEN"
          while [ ! -e {release} ]; do sleep 0.1; done
    """)
    submitted = air("run", "-f", str(path), "--json")
    assert submitted.returncode == 0, submitted.stderr
    run_id = json.loads(submitted.stdout)["data"]["run_id"]
    try:
        for node in (0, 1):
            log = RunPaths(run_id).node_log(0, node)
            wait_for(lambda log=log, node=node: log.exists() and f"node {node} token is ***" in log.read_text(),
                     f"node {node}'s masked line in {log}", timeout=240, interval=0.01)
        agent_logs = [p for n in (0, 1) for p in node_work_root(run_id, n).rglob("proc_*.log")]
        assert len(agent_logs) == 2, agent_logs
        for log in agent_logs:
            assert "token is ***" in log.read_text() and secret not in log.read_text(), log
    finally:
        release.touch()
    assert wait_terminal(run_id, timeout=240).status.value == "SUCCESS"
    assert grep_home(air_home, secret) == [str(air_home / "secrets.json")]
