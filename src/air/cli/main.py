"""`air`: entry point and command groups."""

from __future__ import annotations

import click

from air import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="air")
def cli() -> None:
    """air: run PyTorch training once per GPU, on one machine or many, and keep every result."""


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
