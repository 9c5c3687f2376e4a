"""Bounded YAML (issue 22): an alias bomb, deep nesting and huge integers are refused while the document is
composed, with the file and line, in bounded memory and time; --override values and a requirements YAML
named by the workload go through the same bounds."""

from __future__ import annotations

import resource
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from air.bounds import (
    MAX_INT,
    MAX_YAML_ALIAS_VALUES,
    MAX_YAML_DEPTH,
    MIN_INT,
    YamlBoundError,
    compose_bounded,
    safe_load_bounded,
)
from air.errors import UserInputError
from air.workload.loading import WorkloadSpecError, load_workload

BASE = ("experiment_name: demo\n"
        "compute: {num_accelerators: 2, accelerator_type: CPU_2xCPU}\n"
        "command: echo hi\n")


def alias_bomb(levels: int = 9, fold: int = 9) -> str:
    """The "billion laughs": each level an anchored list of `fold` aliases of the level below."""
    names = "abcdefghijklmnop"[:levels]
    lines = [f" a: &a [{', '.join(['x'] * fold)}]"]
    for below, name in zip(names, names[1:], strict=False):
        aliases = ", ".join([f"*{below}"] * fold)
        lines.append(f" {name}: &{name} [{aliases}]")
    return "parameters:\n" + "\n".join(lines) + "\n"


CASES = {
    # name: (the YAML after BASE, the line it is refused at, a phrase of the refusal)
    "alias-bomb": (alias_bomb(), 10, "aliases (*name) expand to more than"),
    "deep-list": ("parameters:\n  x: " + "[" * 10_000 + "\n", 5, f"nested deeper than {MAX_YAML_DEPTH} levels"),
    "deep-map": ("parameters:\n  x: " + "{a: " * 10_000 + "\n", 5, f"nested deeper than {MAX_YAML_DEPTH} levels"),
    "huge-int": ("parameters:\n  seed: " + "7" * 5_000 + "\n", 5, "the integer 777777777777…777777 (5000 characters)"),
}


def air_dry_run(path: Path, *extra: str) -> tuple[subprocess.CompletedProcess[str], float]:
    """The real CLI under `ulimit -v 2000000` (2 GB of address space): its answer, and the CPU seconds it
    spent (the child's own user + system time: what the bound is about, unlike wall time, which a loaded
    machine stretches)."""
    command = shlex.join([sys.executable, "-m", "air.cli.main", "run", "-f", str(path), "--dry-run", *extra])
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = subprocess.run(["bash", "-c", f"ulimit -v 2000000; exec {command}"], capture_output=True,
                            text=True, timeout=120, cwd=path.parent)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return result, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def test_the_bomb_is_small_and_would_expand_past_a_billion_values() -> None:
    assert len(alias_bomb()) < 520
    assert 9 ** 9 > 300_000_000 > MAX_YAML_ALIAS_VALUES  # what it would be without the budget


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_cli_refuses_hostile_yaml_in_bounded_memory_and_time(tmp_path: Path, case: str) -> None:
    """Must show: exit 2 under a 2 GB address-space limit, in under 5 s of CPU, naming the file, line and what to do."""
    text, line, phrase = CASES[case]
    path = tmp_path / f"{case}.yaml"
    path.write_text(BASE + text)
    result, seconds = air_dry_run(path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"{path.name}: line {line}: {phrase}" in result.stderr, result.stderr
    assert "Internal error" not in result.stderr and "Traceback" not in result.stderr
    hint = result.stderr.splitlines()[-1]
    assert any(word in hint for word in ("Write", "Flatten", "Quote")), result.stderr  # what to do
    assert seconds < 5, f"{case}: {seconds:.1f} s"


def test_a_workload_within_the_bounds_still_runs_dry(tmp_path: Path) -> None:
    """Anchors used as people use them (a shared block), and 64-bit integers at both ends, pass."""
    path = tmp_path / "ok.yaml"
    path.write_text(BASE + f"parameters:\n  base: &base {{lr: 0.1, seed: {MAX_INT}}}\n  tuned: *base\n"
                    f"  low: {MIN_INT}\n  hex: 0x7fffffffffffffff\n")
    result, _ = air_dry_run(path)
    assert result.returncode == 0, result.stderr
    spec = load_workload(path)
    assert spec.parameters == {"base": {"lr": 0.1, "seed": MAX_INT}, "tuned": {"lr": 0.1, "seed": MAX_INT},
                               "low": MIN_INT, "hex": MAX_INT}


def test_override_values_go_through_the_same_bounds(tmp_path: Path) -> None:
    path = tmp_path / "ok.yaml"
    path.write_text(BASE)
    for override, phrase in ((f"parameters.seed={'9' * 5000}", "the integer"),
                             ("parameters.x=" + "[" * 10_000, "nested deeper than"),
                             ("max_retries=" + "9" * 30, "out of range")):
        result, seconds = air_dry_run(path, "--override", override)
        assert result.returncode == 2, result.stderr
        assert phrase in result.stderr and "(from --override" in result.stderr, result.stderr
        assert len(result.stderr) < 2000, "the override is shown cut short, not 5000 digits long"
        assert seconds < 5
    fits = "parameters.x=[&a [1,2,3], " + ", ".join(["*a"] * 9) + "]"
    assert load_workload(path, overrides=[fits]).parameters == {"x": [[1, 2, 3]] * 10}
    huge = "parameters.x=[&a [" + ",".join(["1"] * 1000) + "], " + ", ".join(["*a"] * 200) + "]"
    with pytest.raises(WorkloadSpecError, match=r"parameters\.x: aliases \(\*name\) expand to more than"):
        load_workload(path, overrides=[huge])


def test_a_requirements_yaml_named_by_the_workload_is_bounded(tmp_path: Path) -> None:
    (tmp_path / "env.yaml").write_text("version: 1\ndependencies:\n  - &a [x, x, x, x, x, x, x, x, x, x]\n"
                                       + "".join(f"  - &{c} [{', '.join([f'*{p}'] * 10)}]\n"
                                                 for p, c in zip("abcde", "bcdef", strict=True)))
    path = tmp_path / "train.yaml"
    path.write_text(BASE + "environment:\n  dependencies: env.yaml\n")
    result, seconds = air_dry_run(path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "env.yaml: line 7: aliases (*name) expand to more than" in result.stderr, result.stderr
    assert seconds < 5


# ---- the loader itself ------------------------------------------------------------------------------


def test_the_alias_budget_counts_expanded_values() -> None:
    """A list of n values named by k aliases costs k * (n + 1): just within the budget passes, one more fails."""
    per_alias = 1000 + 1
    fits = MAX_YAML_ALIAS_VALUES // per_alias
    items = ",".join(["1"] * 1000)
    data = safe_load_bounded(f"a: &a [{items}]\nb: [{', '.join(['*a'] * fits)}]\n")
    assert len(data["b"]) == fits
    with pytest.raises(YamlBoundError, match="expand to more than") as info:
        safe_load_bounded(f"a: &a [{items}]\nb: [{', '.join(['*a'] * (fits + 1))}]\n")
    assert info.value.line == 2


def test_depth_is_counted_exactly() -> None:
    assert safe_load_bounded("[" * (MAX_YAML_DEPTH - 1) + "]" * (MAX_YAML_DEPTH - 1)) is not None
    with pytest.raises(YamlBoundError, match=f"deeper than {MAX_YAML_DEPTH}"):
        safe_load_bounded("[" * (MAX_YAML_DEPTH + 1) + "]" * (MAX_YAML_DEPTH + 1))


def test_a_recursive_alias_is_refused() -> None:
    with pytest.raises(YamlBoundError, match=r"\*a is inside the value it names"):
        compose_bounded("x: &a [1, *a]\n")


@pytest.mark.parametrize("text", [str(MAX_INT + 1), str(MIN_INT - 1), "0x" + "f" * 17, "1" * 4400,
                                  "1:" * 3000 + "1", "1_000_000_000_000_000_000_000"])
def test_integers_beyond_64_bits_are_refused(text: str) -> None:
    with pytest.raises(YamlBoundError, match="out of range"):
        safe_load_bounded(f"n: {text}\n")
    assert safe_load_bounded(f"n: '{text}'\n") == {"n": text}  # quoted, it is text


def test_a_problem_under_an_alias_is_reported_once_at_its_line(tmp_path: Path) -> None:
    path = tmp_path / "train.yaml"
    path.write_text(BASE + "env_variables: &env\n  A: [1]\nparameters:\n  x: *env\n")
    with pytest.raises(WorkloadSpecError) as info:
        load_workload(path)
    assert [str(p.loc) for p in info.value.problems] == [str(("env_variables", "A"))]
    assert "(line 5)" in str(info.value)


def test_a_bound_is_a_user_error_in_the_library_too(tmp_path: Path) -> None:
    path = tmp_path / "deep.yaml"
    path.write_text(BASE + CASES["deep-map"][0])
    with pytest.raises(UserInputError, match=r"deep\.yaml: line 5: nested deeper than") as info:
        load_workload(path)
    assert info.value.exit_code == 2
