"""Benchmark `air.runtime.heartbeat()`: called every training step, it must cost < 1 µs median per call.

    .venv/bin/python benchmarks/bench_heartbeat.py [--calls 2000000] [--repeat 7]

Runs with a real heartbeat slot (air.launcher.progress.HeartbeatSlots, in /dev/shm where there is one,
as a launched process gets it through AIR_HEARTBEAT_FILE) and reports, per call, the median over
`--repeat` rounds of `--calls` calls each:

* `heartbeat()` (time-throttled: one clock read per call, a write into the mapped slot every 0.5 s);
* the peers a training step already pays: an empty Python function call, and `time.monotonic()`;
* the slot write itself (`_beat`, unthrottled), and what the launcher reads back.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable


def per_call_ns(fn: Callable[[], object], calls: int, repeat: int) -> float:
    rounds = []
    for _ in range(repeat):
        start = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter_ns() - start) / calls)
    return statistics.median(rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2_000_000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()

    from air.launcher.progress import HeartbeatSlots
    from air.settings import AIR_HEARTBEAT_FILE

    slots = HeartbeatSlots(1)
    os.environ[AIR_HEARTBEAT_FILE] = slots.paths[0]
    try:
        from air import runtime

        def noop() -> None:
            pass

        def beat_unthrottled() -> None:
            runtime._beat(time.time())

        results = {
            "heartbeat()": per_call_ns(runtime.heartbeat, args.calls, args.repeat),
            "empty function call (peer)": per_call_ns(noop, args.calls, args.repeat),
            "time.monotonic() (peer)": per_call_ns(time.monotonic, args.calls, args.repeat),
            "slot write, unthrottled": per_call_ns(beat_unthrottled, args.calls // 10, args.repeat),
        }
        seen = time.time() - slots.read(0)
        base = results["empty function call (peer)"]
        print(f"{'what':32} {'median ns/call':>15} {'x empty call':>13}")
        for name, ns in results.items():
            print(f"{name:32} {ns:15.1f} {ns / base:13.2f}")
        print(f"launcher reads the last beat as {seen:.3f} s old; target: heartbeat() < 1000 ns median "
              f"-> {'OK' if results['heartbeat()'] < 1000 else 'MISSED'}")
    finally:
        slots.close()


if __name__ == "__main__":
    main()
