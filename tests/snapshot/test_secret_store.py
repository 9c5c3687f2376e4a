"""The local secret store: owner-only file, clear errors for missing secrets, values masked in text."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from air.errors import NotFoundError, UserInputError
from air.home import air_home
from air.workload.secrets import (
    delete_secret,
    list_secrets,
    mask_secrets,
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
