"""Is a run's supervisor alive: its recorded pid, checked against the process create time (pids get reused)."""

from __future__ import annotations

from air.store.records import Run


def process_create_time(pid: int) -> float | None:
    """The create time of process `pid` (epoch seconds), or None if there is no such process."""
    import psutil

    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied, ValueError):
        return None


def supervisor_alive(run: Run, *, tolerance_s: float = 1.0) -> bool | None:
    """Is the run's recorded supervisor still running — the same process, not a reused pid?

    None when no supervisor was recorded yet (a run just submitted); False when the pid is gone, a
    zombie, or now belongs to a process created at another time.
    """
    if run.supervisor_pid is None or run.supervisor_started_at is None:
        return None
    return process_alive(run.supervisor_pid, run.supervisor_started_at, tolerance_s=tolerance_s)


def process_alive(pid: int, started_at: float, *, tolerance_s: float = 1.0) -> bool:
    """Is process `pid` running and the one created at `started_at` (not a reused pid)?"""
    import psutil

    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return abs(proc.create_time() - started_at) <= tolerance_s
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:
        return True  # it exists and we cannot tell more: never declare a supervisor dead on a guess

