"""Benchmark output: a node printing fast is not slowed by air, and a watcher's memory stays bounded.

    .venv/bin/python benchmarks/bench_output.py [--gb 1.0] [--repeat 3] [--line-mb 300] [--lines-gb 0.3]

In a temporary AIR_HOME (removed at the end), on the local backend, through the real CLI:

* node: a workload whose command is `yes | head -c N` (N = --gb GB of 2-byte lines), submitted with
  `air run` (no watcher); the time its node command took, measured inside the node, beside the same
  command without air: `bash -c 'yes | head -c N > /dev/null'` and `> FILE` (the same disk as the log).
  Medians of --repeat; the target is node ≤ 2× without air. The whole `air run` to SUCCESS is shown too
  (it adds the run's start-up and end), and the launcher alone in this process with its CPU seconds (the
  pump's and the command's), which a loaded machine does not blur as it does wall times.
* watch, one line: `air run --watch` of a run printing one --line-mb MB line (stdout discarded): the
  CLI's peak RSS (psutil, sampled every 10 ms); the target is < 100 MB. Then `air logs ID` of it.
* watch, many lines: the same with --lines-gb GB of --line-width-byte lines (0 skips it).
  `--gb 0` runs only the watchers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import psutil

AIR = [sys.executable, "-m", "air.cli.main"]


def workload(folder: Path, name: str, command: str) -> Path:
    path = folder / f"{name}.yaml"
    path.write_text(textwrap.dedent(f"""\
        experiment_name: {name}
        compute: {{num_accelerators: 1, accelerator_type: CPU_1xCPU}}
        max_retries: 0
        timeout_minutes: 30
        command: {json.dumps(command)}
        """))
    return path


def timed_shell(command: str) -> float:
    start = time.perf_counter()
    subprocess.run(["bash", "-c", command], check=True)
    return time.perf_counter() - start


def wait_terminal(run_id: str, timeout: float = 1800) -> str:
    from air.store.run_store import RunStore

    store = RunStore()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = store.get_run(run_id)
        if run.is_terminal:
            return run.status.value
        time.sleep(0.05)
    raise SystemExit(f"run {run_id} did not end in {timeout} s")


def air_node(folder: Path, size: int, rep: int) -> tuple[float, float]:
    """(seconds the node command took, seconds from `air run` to SUCCESS) for `yes | head -c size`."""
    stamps = folder / f"stamps_{rep}"
    # `|| true`: the node runs under `set -o pipefail`, and `yes` ends by SIGPIPE when head has enough
    command = f"date +%s.%N > {stamps}; {{ yes || true; }} | head -c {size}; date +%s.%N >> {stamps}"
    start = time.perf_counter()
    submitted = subprocess.run([*AIR, "run", "-f", str(workload(folder, f"out-node-{rep}", command)), "--json"],
                               capture_output=True, text=True, check=True)
    run_id = json.loads(submitted.stdout)["data"]["run_id"]
    status = wait_terminal(run_id)
    whole = time.perf_counter() - start
    if status != "SUCCESS":
        from air.store.run_store import RunStore

        raise SystemExit(f"run {run_id} ended {status}: {RunStore().get_run(run_id).termination_reason}")
    began, ended = (float(v) for v in stamps.read_text().split())
    from air.store.paths import RunPaths

    log = RunPaths(run_id).node_logs(0)[0]
    if log.stat().st_size != size:
        raise SystemExit(f"the log holds {log.stat().st_size} bytes, not {size}")
    shutil.rmtree(RunPaths(run_id).folder, ignore_errors=True)  # 1 GB each: not kept between repeats
    return ended - began, whole


def launcher_alone(folder: Path, size: int) -> tuple[float, float, float]:
    """(wall s, this process's CPU s: the pump, the children's CPU s) of `yes | head -c size` started by
    the launcher here (`start_processes`, the pump a thread of this process): CPU is what load cannot blur."""
    import resource

    from air.launcher.node import ProcessSpec, start_processes

    log = folder / "launcher.log"
    before, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    launch = start_processes([ProcessSpec("yes", ["bash", "-c", f"yes | head -c {size}"], dict(os.environ), log)],
                             tag="bench-output", grace_s=2.0)
    launch.wait(timeout=1800)
    wall = time.perf_counter() - start
    after, children_after = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    if log.stat().st_size != size:
        raise SystemExit(f"the launcher's log holds {log.stat().st_size} bytes, not {size}")
    log.unlink()
    Path(str(log) + ".times").unlink(missing_ok=True)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    child_cpu = (children_after.ru_utime + children_after.ru_stime - children.ru_utime - children.ru_stime)
    return wall, cpu, child_cpu


def peak_rss(argv: list[str]) -> tuple[float, int, str]:
    """(peak RSS in MiB of the process, its exit code, the last 300 characters of its stdout)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    tail = bytearray()

    def drain() -> None:
        assert proc.stdout is not None
        while chunk := proc.stdout.read(1 << 16):
            tail.extend(chunk)
            del tail[:-300]

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    peak = 0
    ps = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            peak = max(peak, ps.memory_info().rss)
        except psutil.NoSuchProcess:
            break
        time.sleep(0.01)
    reader.join()
    return peak / (1 << 20), proc.returncode, tail.decode("utf-8", "replace")


def watch(folder: Path, name: str, command: str) -> tuple[float, float, str]:
    """(peak RSS MiB of `air run --watch`, of `air logs ID` afterwards, the end of the watch's output)."""
    from air.store.run_store import RunStore

    peak, code, tail = peak_rss([*AIR, "run", "-f", str(workload(folder, name, command)), "--watch"])
    if code != 0:
        raise SystemExit(f"--watch of {name} exited {code}: {tail}")
    run_id = RunStore().list_runs(statuses="all", experiment_glob=name, limit=1)[0].id
    logs_peak, _, _ = peak_rss([*AIR, "logs", run_id])
    return peak, logs_peak, tail


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--line-mb", type=float, default=300)
    parser.add_argument("--lines-gb", type=float, default=0.3)
    parser.add_argument("--line-width", type=int, default=200, help="bytes per line of --lines-gb (2 or more)")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="air-bench-output-"))
    os.environ["AIR_HOME"] = str(home / "air")
    folder = home / "work"
    folder.mkdir()
    size = int(args.gb * 1e9)
    try:
        null_s, file_s, node_s, whole_s, alone = [], [], [], [], []
        for rep in range(args.repeat if size > 0 else 0):  # --gb 0: only the watchers
            alone.append(launcher_alone(folder, size))
            null_s.append(timed_shell(f"yes | head -c {size} > /dev/null"))
            file_s.append(timed_shell(f"yes | head -c {size} > {folder / 'plain.out'}"))
            os.unlink(folder / "plain.out")
            node, whole = air_node(folder, size, rep)
            node_s.append(node)
            whole_s.append(whole)
        med = statistics.median
        if size > 0:
            print(f"{args.gb:g} GB of 2-byte lines, median of {args.repeat} (seconds):")
            print(f"  without air, > /dev/null   {med(null_s):7.2f}   {null_s}")
            print(f"  without air, > file        {med(file_s):7.2f}   {file_s}")
            print(f"  air node command           {med(node_s):7.2f}   {node_s}")
            print(f"  air run → SUCCESS (whole)  {med(whole_s):7.2f}   {whole_s}")
            print(f"  launcher alone (wall, pump CPU, command CPU) {[tuple(round(v, 2) for v in a) for a in alone]}")
            print(f"  node / file: {med(node_s) / med(file_s):.2f}x   node / null: {med(node_s) / med(null_s):.2f}x"
                  f"   (target ≤ 2x)")
        line_bytes = int(args.line_mb * 1e6)
        peak, logs_peak, tail = watch(folder, "out-line", f"head -c {line_bytes} /dev/zero | tr '\\0' x; echo")
        print(f"--watch of one {args.line_mb:g} MB line: peak RSS {peak:.0f} MiB (target < 100); "
              f"air logs of it: {logs_peak:.0f} MiB; shown: …{tail.strip()[-60:]!r}")
        if args.lines_gb > 0:
            width = max(args.line_width, 2)
            lines = int(args.lines_gb * 1e9 / width)
            peak, logs_peak, _ = watch(folder, "out-lines", f"{{ yes {'y' * (width - 1)} || true; }} | head -n {lines}")
            print(f"--watch of {args.lines_gb:g} GB of {width}-byte lines: peak RSS {peak:.0f} MiB; "
                  f"air logs (last 10,000 lines): {logs_peak:.0f} MiB")
    finally:
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
