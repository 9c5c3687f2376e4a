"""`air register image URL`: resolve a container image to its digest, pull it into this machine's podman
storage and record it ($AIR_HOME/images.json), so runs naming it in `environment.docker_image` start at
once (air/environments/containers.py)."""

from __future__ import annotations

import click

from air.cli.main import common, settings
from air.cli.output import envelope, status


@click.group()
def register() -> None:
    """Register things runs use ahead of time (container images)."""


@register.command("image")
@click.argument("url")
@click.option("--tag-policy", type=click.Choice(["auto", "latest"]), default="auto", show_default=True,
              help="auto: reuse the image registered here; latest: ask the registry and pull again if the tag moved.")
@click.option("--timeout-minutes", type=click.IntRange(1, 24 * 60), default=60, show_default=True,
              help="Give up resolving and pulling after this long.")
@click.option("--scope", default=None, help="Secret scope holding the registry's credentials (USER:PASSWORD).")
@click.option("--key", default=None, help="Secret key holding the registry's credentials (with --scope).")
@common
def image(url: str, tag_policy: str, timeout_minutes: int, scope: str | None, key: str | None) -> None:
    """Resolve URL to a digest, pull and cache it on this machine. Credentials: the secret --scope/--key,
    else podman's own (`podman login`, ~/.docker/config.json). Registries follow registries.conf."""
    from air.environments.containers import register as register_image
    from air.errors import UserInputError
    from air.workload.image_spec import image_credentials

    if (scope is None) != (key is None):
        raise UserInputError("--scope and --key go together (the secret holding USER:PASSWORD).")
    status(f"resolving {url} ({tag_policy}) …")
    record = register_image(url, tag_policy=tag_policy, timeout_minutes=timeout_minutes,
                            credentials=image_credentials({"credentials_scope": scope, "credentials_key": key}))
    if settings().json:
        envelope(record.to_dict())
        return
    how = f"pulled in {record.pull_seconds:.1f} s" if record.pulled else "already here (reused)"
    print(f"Registered {record.url}\n  digest: {record.digest}\n  image:  {record.image_id[:12]} ({how})\n"
          f"  python: {record.python}")
