"""Real `@distributed` calls on CPU ranks: results, environment, output, DDP."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import rank_programs as rp
import torch

from air import distributed


def test_two_rank_ddp_training_ends_with_identical_parameters() -> None:
    results = distributed(num_accelerators=2, accelerator_type="CPU")(rp.ddp_train).distributed(steps=5)
    assert len(results) == 2
    assert results[0] == results[1]
    assert len(results[0]) == 5  # Linear(4, 1): 4 weights + 1 bias
    torch.manual_seed(0)
    initial = [float(v) for p in torch.nn.Linear(4, 1).parameters() for v in p.detach().flatten()]
    assert results[0] != pytest.approx(initial)  # training moved them, identically on both ranks


def test_results_are_ordered_by_rank_and_env_is_torchrun_compatible() -> None:
    reports = distributed(num_accelerators=3, accelerator_type="CPU")(rp.env_report).distributed()
    assert [r["RANK"] for r in reports] == ["0", "1", "2"]
    assert [r["LOCAL_RANK"] for r in reports] == ["0", "1", "2"]
    for r in reports:
        assert (r["WORLD_SIZE"], r["LOCAL_WORLD_SIZE"], r["NODE_RANK"], r["GROUP_RANK"]) == ("3", "3", "0", "0")
        assert r["MASTER_ADDR"] == "127.0.0.1" and r["PYTHONUNBUFFERED"] == "1"
        assert r["MASTER_PORT"] == reports[0]["MASTER_PORT"] and r["MASTER_PORT"] != "29500"
    assert distributed(2, "CPU")(rp.runtime_report).distributed() == [(0, 0, 2, 2, 0), (1, 1, 2, 2, 0)]


def test_every_line_reaches_the_caller_prefixed_and_the_rank_log(air_home: Path,
                                                                 capfd: pytest.CaptureFixture[str]) -> None:
    assert distributed(2, "CPU")(rp.print_lines).distributed(50) == [50, 50]
    out, err = capfd.readouterr()
    for rank in (0, 1):
        assert sum(1 for line in out.splitlines() if line.startswith(f"[rank {rank}] out {rank} ")) == 50
        assert sum(1 for line in err.splitlines() if line.startswith(f"[rank {rank}] err {rank} ")) == 50
    logs = sorted((air_home / "runs").glob("*/attempt_0/rank_*.log"))
    assert [p.name for p in logs] == ["rank_0.log", "rank_1.log"]
    text = logs[1].read_text()
    assert "out 1 49" in text and "err 1 49" in text


def test_concurrent_calls_get_distinct_ports(tmp_path: Path) -> None:
    script = tmp_path / "four_calls.py"  # (not concurrent.py: it would shadow the standard library's package)
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(rp.__file__).parent)!r})
        import rank_programs as rp
        from air import distributed
        print(distributed(2, "CPU")(rp.env_report).distributed()[0]["MASTER_PORT"])
    """))
    procs = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True) for _ in range(4)]
    ports = [p.communicate(timeout=120)[0].strip().splitlines()[-1] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len(set(ports)) == 4


def test_launcher_process_never_imports_torch(tmp_path: Path) -> None:
    script = tmp_path / "no_torch.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(rp.__file__).parent)!r})
        import rank_programs as rp
        from air import distributed
        assert distributed(2, "CPU")(rp.ddp_train).distributed(steps=1)
        print("torch" in sys.modules)
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False"
