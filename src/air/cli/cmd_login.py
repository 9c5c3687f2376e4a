"""`air login URL`: save an `air server` as a profile, its token in an owner-only file.

The token is read from stdin (piped) or a hidden prompt, never from an argument, so it stays out of shell
history and `ps`; config.yaml gets the profile with a `token_path`, never the token itself. The token is
checked against the server (`/whoami`) before anything is written: a wrong one leaves no trace.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any

import click
import yaml

from air.cli.main import common, settings
from air.cli.output import envelope, status
from air.errors import UserInputError

#: The profile `air login` writes unless -p names another.
DEFAULT_LOGIN_PROFILE = "remote"
_PROFILE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@click.command()
@click.argument("url")
@click.argument("extra", nargs=-1, metavar="")
@click.option("--default/--no-default", "make_default", default=True,
              help="Make this profile config.yaml's default_profile (then every air command goes to the server; "
              "-p local works on this machine).")
@common
def login(url: str, extra: tuple[str, ...], make_default: bool) -> None:
    """Save an air server as a profile named by -p (default 'remote'); the token comes from stdin or a
    hidden prompt, never an argument, and is kept in $AIR_HOME/tokens/NAME.token (0600).

    \b
    air login http://gpu-box:8765                 (asks for the token)
    air login http://gpu-box:8765 < token.txt     (the admin made it: air server token create NAME)
    """
    from air.client import RemoteError, ServerClient
    from air.config import LOCAL_PROFILE, load_config
    from air.files import atomic_write_bytes, atomic_write_text
    from air.home import AirHome

    if extra:  # not echoed back: it may be the token
        raise UserInputError("air login takes one argument, the server's URL; the token is never an argument "
                             "(it would stay in your shell history and in `ps`).",
                             hint="Paste it at the prompt, or pipe it: air login URL < token.txt")
    name = settings().profile or DEFAULT_LOGIN_PROFILE
    if not _PROFILE_RE.match(name) or name == LOCAL_PROFILE:
        raise UserInputError(f"{name!r} cannot name a server profile.",
                             hint="Use letters, digits, '.', '_' or '-' (not 'local'), e.g. -p team.")
    url = url.rstrip("/")
    token = _read_token()
    client = ServerClient(url, token)  # checks the URL's form
    try:
        who = client.get("/whoami")
    except RemoteError as exc:
        if exc.http_status in (401, 403):
            raise UserInputError(f"The air server at {url} refused the token: {exc.message}",
                                 hint="Ask its admin for a token (air server token create NAME); nothing was "
                                 "saved.") from None
        raise
    home = AirHome()
    config = load_config()  # the current file must be valid before we add to it
    path = config.path or home.config
    raw: dict[str, Any] = {}
    if path.is_file():
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
        raw = loaded if isinstance(loaded, dict) else {}
    token_file = home.tokens / f"{name}.token"
    profiles = raw.get("profiles") or {}
    profiles[name] = {"backend": "server", "url": url, "token_path": str(token_file)}
    raw["profiles"] = profiles
    if make_default:
        raw["default_profile"] = name
    home.tokens.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(home.tokens, 0o700)
    previous = token_file.read_bytes() if token_file.is_file() else None
    atomic_write_text(token_file, token + "\n", mode=0o600)
    try:
        # config.yaml replaced only with a file air reads back as valid, its mode kept
        atomic_write_text(path, yaml.safe_dump(raw, sort_keys=False, default_flow_style=False), check=load_config,
                          mode=path.stat().st_mode & 0o777 if path.exists() else 0o600)
    except BaseException:  # a refused config leaves the token as it was
        if previous is None:
            token_file.unlink(missing_ok=True)
        else:
            atomic_write_bytes(token_file, previous, mode=0o600)
        raise
    user = who.get("user") if isinstance(who, dict) else None
    if settings().json:
        envelope({"profile": name, "url": url, "user": user, "token_path": str(token_file),
                  "default": make_default, "config": str(path)})
        return
    status(f"Logged in to {url} as {user or '?'}: profile {name!r} in {path}, token in {token_file} (0600).")
    status("Every air command now goes there (air list runs); -p local works on this machine."
           if make_default else f"Use it with: air -p {name} list runs")


def _read_token() -> str:
    """The token from stdin when it is piped, else a hidden prompt."""
    if sys.stdin is not None and not sys.stdin.isatty():
        token = sys.stdin.readline(4096).strip()  # a token is ~50 characters: never read a file whole
    else:
        token = click.prompt("Token (from: air server token create NAME)", hide_input=True, err=True).strip()
    if not token:
        raise UserInputError("No token given: air login reads it from stdin or a prompt.",
                             hint="e.g. air login URL < token.txt   (never as an argument: it would stay in your "
                             "shell history)")
    if any(c.isspace() for c in token) or len(token) > 512:
        raise UserInputError("That does not look like an air server token (one word, no spaces).")
    return token
