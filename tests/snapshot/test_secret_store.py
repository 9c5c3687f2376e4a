"""The local secret store: owner-only file, clear errors for missing secrets, values masked in text."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from air.errors import NotFoundError, SecretMaskingError, UserInputError
from air.home import air_home
from air.workload.secrets import (
    delete_secret,
    list_secrets,
    mask_secrets,
    masker_for_run,
    parse_secret_ref,
    put_secret,
    resolve_secrets,
    secrets_path,
)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_store_is_created_owner_only_even_with_a_permissive_umask() -> None:
    old = os.umask(0)
    try:
        put_secret("hf", "token", "hf_abc")
    finally:
        os.umask(old)
    path = air_home() / "secrets.json"
    assert secrets_path() == path
    assert _mode(path) == 0o600
    assert _mode(Path(f"{path}.lock")) == 0o600
    assert [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")] == []


def test_put_list_resolve_delete(tmp_path: Path) -> None:
    store = tmp_path / "s.json"
    put_secret("hf", "token", "hf_abc", store=store)
    put_secret("wandb", "api-key", "w1", store=store)
    put_secret("hf", "token", "hf_new", store=store)  # replaces
    assert list_secrets(store=store) == [("hf", "token"), ("wandb", "api-key")]
    assert "hf_new" not in repr(list_secrets(store=store))
    assert resolve_secrets({"HF_TOKEN": "hf/token", "WANDB_API_KEY": "wandb/api-key"}, store=store) == {
        "HF_TOKEN": "hf_new",
        "WANDB_API_KEY": "w1",
    }
    delete_secret("wandb", "api-key", store=store)
    assert list_secrets(store=store) == [("hf", "token")]
    assert "wandb" not in json.loads(store.read_text())["scopes"]
    with pytest.raises(NotFoundError, match="wandb/api-key"):
        delete_secret("wandb", "api-key", store=store)
    assert _mode(store) == 0o600


def test_missing_secrets_are_all_named_with_the_command_to_add_them(tmp_path: Path) -> None:
    store = tmp_path / "s.json"
    put_secret("hf", "token", "x", store=store)
    with pytest.raises(UserInputError) as info:
        resolve_secrets({"A": "hf/token", "B": "db/password", "C": "aws/key"}, store=store)
    text = str(info.value)
    assert "db/password (for B)" in text and "aws/key (for C)" in text and "hf/token" not in text
    assert "air secrets put db password" in text and "air secrets put aws key" in text
    assert "stdin" in text
    assert info.value.exit_code == 2


def test_no_store_file_means_every_secret_is_missing(tmp_path: Path) -> None:
    assert list_secrets(store=tmp_path / "none.json") == []
    assert resolve_secrets({}, store=tmp_path / "none.json") == {}
    with pytest.raises(UserInputError, match="air secrets put s k"):
        resolve_secrets({"X": "s/k"}, store=tmp_path / "none.json")


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_a_store_others_can_read_is_refused(tmp_path: Path, mode: int) -> None:
    store = tmp_path / "s.json"
    put_secret("s", "k", "v", store=store)
    store.chmod(mode)
    for call in (
        lambda: resolve_secrets({"X": "s/k"}, store=store),
        lambda: list_secrets(store=store),
        lambda: put_secret("s", "k2", "v", store=store),
    ):
        with pytest.raises(UserInputError, match=f"(?s)mode {mode:04o}.*chmod 600"):
            call()


def test_a_corrupt_store_is_a_clear_error(tmp_path: Path) -> None:
    store = tmp_path / "s.json"
    fd = os.open(store, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"{not json")
    os.close(fd)
    with pytest.raises(UserInputError, match="not valid"):
        list_secrets(store=store)


@pytest.mark.parametrize("ref", ["nokey", "a/b/c", "/k", "s/", "has space/k", ""])
def test_bad_references(ref: str) -> None:
    with pytest.raises(UserInputError, match="scope/key"):
        parse_secret_ref(ref)
    with pytest.raises(UserInputError, match="secrets.X"):
        resolve_secrets({"X": ref})


def test_bad_names_refused_on_put(tmp_path: Path) -> None:
    with pytest.raises(UserInputError, match="scope"):
        put_secret("a/b", "k", "v", store=tmp_path / "s.json")
    with pytest.raises(UserInputError, match="key"):
        put_secret("a", "", "v", store=tmp_path / "s.json")
    assert not (tmp_path / "s.json").exists()


def test_masking() -> None:
    text = "token=abc123 again abc123; longer=abc123XYZ; empty stays"
    assert mask_secrets(text, ["abc123", "abc123XYZ", ""]) == "token=*** again ***; longer=***; empty stays"
    assert mask_secrets("a.b*c+d", ["b*c"]) == "a.***+d"  # regex characters are literal
    assert mask_secrets("nothing here", []) == "nothing here"
    pem = "-----BEGIN KEY-----\nAAAABBBB\nCCCCDDDD\n-----END KEY-----"
    log_line = "debug: CCCCDDDD"  # one line of a multi-line secret, as a log shows it
    assert mask_secrets(f"key={pem}", [pem]) == "key=***"
    assert mask_secrets(log_line, [pem]) == "debug: ***"


def _plan(folder: Path, refs: dict[str, str]) -> Path:
    path = folder / "submission.json"
    path.write_text(json.dumps({"secret_refs": refs}))
    return path


def test_run_masker_hides_the_runs_secrets(tmp_path: Path) -> None:
    put_secret("team", "token", "t0ken")
    mask = masker_for_run("run-x", _plan(tmp_path, {"API_TOKEN": "team/token"}))
    assert mask("token is t0ken") == "token is ***"
    assert masker_for_run("call-x", None)("t0ken") == "t0ken"  # a run given no secrets has none to hide


def test_run_masker_fails_closed(tmp_path: Path) -> None:
    """Unresolvable secrets, an unreadable plan, a store others can read: an error, never plain text."""
    put_secret("team", "kept", "k")
    plan = _plan(tmp_path, {"API_TOKEN": "team/gone", "OTHER": "team/kept"})
    with pytest.raises(SecretMaskingError) as err:
        masker_for_run("run-x", plan)
    assert err.value.exit_code == 1
    assert "team/gone (for API_TOKEN)" in str(err.value) and "air secrets put team gone" in str(err.value)
    assert "team/kept" not in str(err.value)
    plan.write_text("{not json")
    with pytest.raises(SecretMaskingError, match="cannot be read"):
        masker_for_run("run-x", plan)
    _plan(tmp_path, {"OTHER": "team/kept"})
    os.chmod(secrets_path(), 0o644)
    with pytest.raises(SecretMaskingError, match="chmod 600"):
        masker_for_run("run-x", plan)


def test_run_masker_resolves_at_the_first_line_when_the_plan_comes_later(tmp_path: Path) -> None:
    """`air logs --follow` started while the run is still in setup: the plan is read when lines come."""
    plan = tmp_path / "submission.json"
    mask = masker_for_run("run-x", plan)  # no plan yet: nothing to print yet either
    _plan(tmp_path, {"API_TOKEN": "team/late"})
    with pytest.raises(SecretMaskingError, match="team/late"):
        mask("token is v4lue")
    put_secret("team", "late", "v4lue")
    assert masker_for_run("run-x", plan)("token is v4lue") == "token is ***"
