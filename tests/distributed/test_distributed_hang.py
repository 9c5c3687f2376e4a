"""A rank that stops making progress: the call raises HangError naming it, with its stacks, and leaves
no process behind."""

from __future__ import annotations

import pickle
import time
from pathlib import Path

import pytest
import rank_programs as rp

from air import distributed
from air.errors import HangError
from proc_helpers import alive, read_pids

HANG_TIMEOUT_S = 10.0  # above the ranks' start-up (torch import, rendezvous) on a loaded machine: that counts too


def test_a_stopped_rank_in_an_all_reduce_loop_raises_hang_error_naming_it(pid_dir: Path) -> None:
    call = distributed(num_accelerators=2, accelerator_type="CPU", hang_timeout=HANG_TIMEOUT_S)
    with pytest.raises(HangError) as info:
        call(rp.allreduce_until_stopped).distributed(pid_dir, 1)
    took = time.time() - float((pid_dir.parent / "stopped_at").read_text())  # since rank 1 stopped
    exc = info.value
    assert exc.rank == 1 and str(exc).startswith("Hang: rank 1 made no progress"), str(exc)
    assert "(it is stopped)" in str(exc)
    assert exc.stacks and "allreduce_until_stopped" in exc.stacks, exc.stacks  # py-spy read the stopped rank
    assert exc.stacks_path and Path(exc.stacks_path).read_text().strip() == exc.stacks.strip()
    assert Path(exc.stacks_path).with_name("rank_0.txt").exists()  # every rank's stacks are kept (attempt_<a>/stacks/)
    assert took < HANG_TIMEOUT_S + 10, f"HangError {took:.1f} s after rank 1 stopped"
    pids = read_pids(pid_dir)
    assert len(pids) == 2 and alive(pids) == []
    clone = pickle.loads(pickle.dumps(exc))
    assert isinstance(clone, HangError) and clone.rank == 1 and clone.stacks == exc.stacks


def test_a_rank_that_steps_its_optimizer_in_silence_is_not_hung() -> None:
    """Rank 1 prints nothing for twice the hang timeout, as a DDP rank that leaves printing to rank 0;
    its optimizer steps are its progress.

    The silence under test is the stepping's: a first call without a hang timeout leaves this caller's
    zygote warm (torch imported: seconds on a loaded machine), and each rank beats while it builds its
    optimizer (see rank_programs.silent_optimizer_steps)."""
    assert distributed(num_accelerators=2, accelerator_type="CPU")(rp.silent_optimizer_steps).distributed(0) == [0, 0]
    call = distributed(num_accelerators=2, accelerator_type="CPU", hang_timeout=HANG_TIMEOUT_S)
    steps = call(rp.silent_optimizer_steps).distributed(HANG_TIMEOUT_S * 1.6)
    assert len(steps) == 2 and min(steps) > 20, steps


def test_hang_timeout_is_validated_and_kept_by_with_overrides() -> None:
    call = distributed(num_accelerators=2, accelerator_type="CPU", hang_timeout=30)(rp.print_lines)
    assert call.hang_timeout == 30.0
    assert call.with_overrides(num_accelerators=1).hang_timeout == 30.0
    assert call.with_overrides(hang_timeout=None).hang_timeout is None
    from air.errors import RuntimeConfigurationError

    with pytest.raises(RuntimeConfigurationError, match="hang_timeout must be a positive number"):
        distributed(num_accelerators=2, hang_timeout=0)
