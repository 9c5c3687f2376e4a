"""`air`: the entry point. Known errors become one short paragraph and an exit code (2 bad input, 1
failure); tracebacks only with -v. Global flags work before or after the subcommand."""

from __future__ import annotations

import functools
import sqlite3
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn, TypeVar

import click

from air import __version__
from air.cli.output import Settings, apply, error_envelope, stderr
from air.errors import AirError, StoreError

F = TypeVar("F", bound=Callable[..., object])

VERBOSE_HELP = "Show what air is doing ([air] lines on stderr); -vv for debug detail. Tracebacks on errors."
QUIET_HELP = "Only results and errors: no progress, status lines or spinners."


def settings() -> Settings:
    return click.get_current_context().find_root().ensure_object(Settings)


def default_profile_words() -> str:
    """The profile a command goes to without -p, as it is now: AIR_PROFILE, else config.yaml's
    default_profile (which `air login --default` changes). Read only when a help is shown."""
    import os

    from air.settings import AIR_PROFILE

    if os.environ.get(AIR_PROFILE):
        return f"{os.environ[AIR_PROFILE]!r}, from AIR_PROFILE"
    try:
        from air.config import load_config

        name = load_config().default_profile
    except AirError:  # a broken config.yaml is the command's to report, not its help's
        return "AIR_PROFILE, else config.yaml's default_profile"
    return f"{name!r}: AIR_PROFILE, else config.yaml's default_profile"


class ProfileOption(click.Option):
    """-p/--profile, whose help names the default profile as configured (not a fixed 'local')."""

    def get_help_record(self, ctx: click.Context) -> tuple[str, str] | None:
        self.help = f"Profile from $AIR_HOME/config.yaml (default: {default_profile_words()})."
        return super().get_help_record(ctx)


def common(func: F) -> F:
    """--json, -p/--profile, -v and -q also after the subcommand (`air list runs --json`)."""

    @click.option("--json", "json_flag", is_flag=True, default=False, help="Machine-readable output (JSON).")
    @click.option("-p", "--profile", "profile_flag", cls=ProfileOption, default=None, metavar="NAME")
    @click.option("-v", "--verbose", "verbose_flag", count=True, help=VERBOSE_HELP)
    @click.option("-q", "--quiet", "quiet_flag", is_flag=True, default=False, help=QUIET_HELP)
    @functools.wraps(func)
    def wrapper(*args: object, json_flag: bool, profile_flag: str | None, verbose_flag: int, quiet_flag: bool,
                **kwargs: object) -> object:
        s = settings()
        s.json = s.json or json_flag
        s.profile = profile_flag or s.profile
        s.verbose += verbose_flag
        s.quiet = s.quiet or quiet_flag
        _check_flags(s)
        apply(s)
        return func(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


#: Subcommand name → (module, attribute); imported only when used, so `air list runs` stays quick.
_COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("air.cli.cmd_run", "run"), "get": ("air.cli.cmd_runs", "get"), "list": ("air.cli.cmd_runs", "list_"),
    "logs": ("air.cli.cmd_logs", "logs"), "cancel": ("air.cli.cmd_cancel", "cancel"),
    "env": ("air.cli.cmd_env", "env"), "secrets": ("air.cli.cmd_secrets", "secrets"), "ui": ("air.cli.cmd_ui", "ui"),
    "prune": ("air.cli.cmd_prune", "prune"), "server": ("air.cli.cmd_server", "server"),
    "login": ("air.cli.cmd_login", "login"), "subscribe": ("air.cli.cmd_subscribe", "subscribe"),
    "register": ("air.cli.cmd_register", "register"),
}
#: Other names of a subcommand (not listed in --help).
_ALIASES: dict[str, str] = {"gc": "prune"}


class AirGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        cmd_name = _ALIASES.get(cmd_name, cmd_name)
        if cmd_name not in _COMMANDS:
            return None
        import importlib

        module, attr = _COMMANDS[cmd_name]
        return getattr(importlib.import_module(module), attr)

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        formatter.write_paragraph()
        formatter.write_text("Workload YAML reference: `air -h config` or `air -h config.<section>` "
                             "(e.g. air -h config.compute). Exit codes: 0 ok, 1 run failed or runtime error, "
                             "2 invalid input.")


@click.group(cls=AirGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="air")
@click.option("--json", "json_flag", is_flag=True, default=False, help="Machine-readable output (JSON).")
@click.option("-p", "--profile", cls=ProfileOption, default=None, metavar="NAME")
@click.option("-v", "--verbose", count=True, help=VERBOSE_HELP)
@click.option("-q", "--quiet", is_flag=True, default=False, help=QUIET_HELP)
@click.pass_context
def cli(ctx: click.Context, json_flag: bool, profile: str | None, verbose: int, quiet: bool) -> None:
    """air: run PyTorch training once per GPU, on one machine or many, and keep every result.

    \b
    Start:   air run -f train.yaml --watch      (or --dry-run to see the plan)
    Look:    air list runs | air get run ID | air logs ID --follow | air ui
    Stop:    air cancel ID
    """
    ctx.ensure_object(Settings)
    s = ctx.obj
    s.json, s.profile, s.verbose, s.quiet = json_flag, profile, verbose, quiet
    _check_flags(s)
    apply(s)
    if ctx.invoked_subcommand not in (None, "ui", "secrets", "server"):
        _reconcile_quietly()


def _check_flags(s: Settings) -> None:
    if s.quiet and s.verbose:
        raise click.UsageError("-q and -v contradict each other; give one of them.")


def _reconcile_quietly() -> None:
    """Any air command notices runs whose supervisor died (and ends their processes), and queued runs
    whose admission loop died (and starts a new one)."""
    try:
        from air.runs.admission import ensure_loop
        from air.runs.reconcile import reconcile
        from air.store.run_store import RunStore

        store = RunStore.if_exists()  # no store yet: no run to check, and nothing to create
        if store is not None and not store.read_only():  # a read-only store is only looked at
            reconcile(store)
            ensure_loop(store)
    except AirError:
        raise
    except Exception as exc:  # a broken reconcile must not block `air list runs`
        stderr(f"air: warning: could not check run supervisors: {exc}")


def _config_help(argv: list[str]) -> int | None:
    """`air -h config[.section]`: help on the workload YAML, generated from its schema."""
    flags = [a for a in argv if a in ("-h", "--help")]
    topics = [a for a in argv if a == "config" or a.startswith("config.")]
    if not flags or not topics or len(argv) != 2:
        return None
    from air.workload.config_help import config_help

    path = topics[0][len("config."):] if topics[0] != "config" else None
    sys.stdout.write(config_help(path).rstrip() + "\n")
    return 0


def _report(exc: AirError, *, json_mode: bool, verbose: bool) -> NoReturn:
    """An AirError as the CLI says it (message and hint, or the --json envelope), then its exit code."""
    if json_mode:
        error_envelope(exc, str(exc))
    else:
        if verbose:
            traceback.print_exc()
        stderr(f"Error: {exc.message}")
        if exc.hint:
            stderr(exc.hint)
    sys.exit(exc.exit_code)


def _unreadable(exc: PermissionError) -> StoreError:
    """A file air needs that this account may not read or write: which, and the ways out."""
    import getpass

    from air.home import AirHome

    home = AirHome(create=False).root
    return StoreError(
        f"This account ({getpass.getuser()}) may not {'read' if exc.filename else 'use'} "
        f"{exc.filename or home}: {exc.strerror or exc}.",
        hint=f"Run as the account that owns {home}, or have it shared for reading: chmod -R go+rX {home}")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    json_mode = "--json" in argv
    verbose = any(a in ("-v", "--verbose") or (a.startswith("-v") and set(a[1:]) == {"v"}) for a in argv)
    try:
        code = _config_help(argv)
        if code is not None:
            sys.exit(code)
        result = cli.main(args=argv, prog_name="air", standalone_mode=False)
        sys.exit(result if isinstance(result, int) else 0)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.Abort as exc:
        # click turns Ctrl-C into Abort (standalone_mode=False): still the shell's 130, no traceback.
        if isinstance(exc.__cause__ or exc.__context__, KeyboardInterrupt):
            stderr("Interrupted.")
            sys.exit(130)
        stderr("Aborted.")
        sys.exit(2)
    except click.ClickException as exc:
        if json_mode:
            error_envelope(None, exc.format_message(), code="INVALID_ARGS", kind="USER")
        else:
            exc.show()
        sys.exit(2)
    except AirError as exc:
        _report(exc, json_mode=json_mode, verbose=verbose)
    except KeyboardInterrupt:
        stderr("Interrupted.")
        sys.exit(130)
    except SystemExit:
        raise
    except sqlite3.Error as exc:  # the run store failed past its opening (a write to a read-only one, a lock)
        from air.home import AirHome
        from air.store.schema import store_error

        _report(store_error(AirHome(create=False).runs_db, exc), json_mode=json_mode, verbose=verbose)
    except PermissionError as exc:  # a file of another account's AIR_HOME that this one may not read
        _report(_unreadable(exc), json_mode=json_mode, verbose=verbose)
    except Exception as exc:  # an unexpected failure: short message, traceback with -v
        if json_mode:
            error_envelope(None, f"{type(exc).__name__}: {exc}")
        else:
            if verbose:
                traceback.print_exc()
            stderr(f"Internal error: {type(exc).__name__}: {exc}\n(run again with -v for the traceback)")
        sys.exit(1)


if __name__ == "__main__":
    main()
