"""`air.torch_distributor.TorchDistributor`: pyspark's class on air, without Spark (issue 26). A function's
call returns rank 0's result; a script path runs once per process and returns None; failures keep the
rank's own exception; bad arguments are refused as pyspark refuses them."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

from air.errors import UserInputError
from air.torch_distributor import TorchDistributor


def allreduce_rank(scale: int, *, offset: int = 0) -> dict[str, int]:
    """A real gloo all-reduce; each rank answers differently, so rank 0's answer is recognisable."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        total = torch.tensor([int(os.environ["RANK"]) + 1])
        dist.all_reduce(total)
        return {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": int(total) * scale + offset,
                "local_rank": int(os.environ["LOCAL_RANK"])}
    finally:
        dist.destroy_process_group()


def fails_on_rank_1() -> None:
    if os.environ["RANK"] == "1":
        raise KeyError("rank one has no such key")


def test_run_returns_rank_0s_result() -> None:
    result = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(allreduce_rank, 10, offset=1)
    assert result == {"rank": 0, "world": 2, "sum": 31, "local_rank": 0}


def test_a_failing_rank_raises_its_own_exception() -> None:
    with pytest.raises(KeyError, match="rank one has no such key"):
        TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(fails_on_rank_1)


def test_a_script_runs_once_per_process_with_its_arguments(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""\
        import os, sys
        open(os.path.join({str(tmp_path)!r}, "rank_" + os.environ["RANK"]), "w").write(
            " ".join(sys.argv[1:]) + " " + os.environ["WORLD_SIZE"])
        """))
    assert TorchDistributor(2, True, False).run(str(script), "--lr", 0.5) is None
    assert (tmp_path / "rank_0").read_text() == "--lr 0.5 2"
    assert (tmp_path / "rank_1").read_text() == "--lr 0.5 2"


def test_a_failing_script_is_an_error_naming_its_exit_code(tmp_path: Path) -> None:
    script = tmp_path / "boom.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    with pytest.raises(RuntimeError, match="boom.py exited with code 3 on rank 1"):
        TorchDistributor(2, True, False).run(str(script))


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
def test_num_processes_must_be_a_positive_int(bad: object) -> None:
    with pytest.raises(ValueError, match="num_processes must be a positive integer"):
        TorchDistributor(num_processes=bad)  # type: ignore[arg-type]


def test_a_script_takes_no_keywords_and_must_exist(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="command-line arguments only"):
        TorchDistributor(1, True, False).run(str(tmp_path / "x.py"), lr=1)
    with pytest.raises(UserInputError, match="no such Python file"):
        TorchDistributor(1, True, False).run(str(tmp_path / "missing.py"))


def test_elsewhere_with_gpus_needs_the_accelerator_type() -> None:
    with pytest.raises(UserInputError, match="say which GPUs"):
        TorchDistributor(8, local_mode=False, use_gpu=True)
    assert TorchDistributor(8, local_mode=False, accelerator_type="GPU_8xH100").accelerator_type == "GPU_8xH100"
    assert "num_processes=2" in repr(TorchDistributor(2, use_gpu=False))


def test_importable_without_pyspark() -> None:
    assert "pyspark" not in sys.modules
