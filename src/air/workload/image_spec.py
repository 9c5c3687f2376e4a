"""`environment.docker_image`: the container image every node of the workload runs in (issue 38).

Its own small section, beside the spec: `url` (required), `tag_policy` (`auto`: reuse the image
registered on this machine; `latest`: ask the registry and pull again when the tag moved) and the secret
holding the registry's credentials (`credentials_scope` + `credentials_key`, together). Exclusive with
`environment.dependencies` and `environment.version` (the image is the environment).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from air.settings import AIR_ISOLATION
from air.workload.spec_rules import fail, show_value

if TYPE_CHECKING:
    from air.environments.containers import ImageRecord


class DockerImageSpec(BaseModel):
    """A container image for the workload's nodes (podman on the local backend; see docs/containers.md)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    url: str = Field(
        ..., description="The image: registry/path:tag (or @sha256:…), pulled and cached on this machine "
        "(`air register image URL` does it ahead of time).", examples=["127.0.0.1:5000/team/train:v1"])
    tag_policy: Literal["auto", "latest"] = Field(
        "auto", description="auto: reuse the image registered here (pulled once); latest: ask the registry "
        "at each submit and pull again when the tag moved.", examples=["latest"])
    credentials_scope: str | None = Field(
        None, description="Secret scope of the registry's credentials (`air secrets`; the value USER:PASSWORD).",
        examples=["registry"])
    credentials_key: str | None = Field(None, description="Secret key of the registry's credentials.",
                                        examples=["ghcr"])

    @field_validator("url", mode="before")
    @classmethod
    def _url(cls, value: object) -> object:
        if isinstance(value, str) and value.strip():
            return value.strip()
        fail(f"must be an image reference like registry/path:tag, got {show_value(value)}")

    @model_validator(mode="after")
    def _together(self) -> DockerImageSpec:
        if (self.credentials_scope is None) != (self.credentials_key is None):
            fail("credentials_scope and credentials_key go together (the secret scope/key holding USER:PASSWORD)")
        return self

    @property
    def secret_ref(self) -> str | None:
        return f"{self.credentials_scope}/{self.credentials_key}" if self.credentials_scope else None


def image_credentials(image: Mapping[str, object], secret_store: Path | str | None = None) -> tuple[str, str] | None:
    """The registry credentials `credentials_scope`/`credentials_key` name (air's secrets), or None: podman's
    own (its auth.json, else ~/.docker/config.json)."""
    scope, key = image.get("credentials_scope"), image.get("credentials_key")
    if not scope or not key:
        return None
    from air.environments.containers import parse_credentials
    from air.workload.secrets import resolve_secrets

    value = resolve_secrets({"REGISTRY": f"{scope}/{key}"},
                            store=Path(secret_store) if secret_store else None)["REGISTRY"]
    return parse_credentials(value, f"environment.docker_image: secret {scope}/{key}")


def prepare_image(image: Mapping[str, object], secret_store: Path | str | None = None, *,
                  backend: str = "local") -> ImageRecord:
    """At submit, before the run exists: the image resolved, pulled and recorded by its tag_policy (a bad
    url, a missing image, wrong credentials, an unreachable registry: a UserInputError, exit 2). The local
    and Slurm backends run nodes in images (a Slurm node without it pulls it by digest); Ray is refused with
    what to do instead."""
    from air.environments.containers import register
    from air.errors import UserInputError

    if os.environ.get(AIR_ISOLATION) and os.geteuid() != 0:  # containers run as each run's account: root's podman
        raise UserInputError(
            "environment.docker_image: this server walls its runs in without root (bwrap mode), so it cannot run "
            "a container as the run owner's account.", hint="Run the server as root (unix-user+bwrap), run it "
            "on your own machine (a local profile), or drop docker_image (environment.dependencies).")
    if backend == "slurm" and os.environ.get(AIR_ISOLATION):
        raise UserInputError(
            "environment.docker_image: this server's Slurm jobs run as their users' accounts, which cannot run "
            "podman containers here.", hint="Install what the workload needs into the Slurm profile's node_python, "
            "or run the image on a local profile of this server.")
    if backend not in ("local", "slurm"):
        raise UserInputError(
            f"environment.docker_image: the {backend} backend does not run nodes in container images (only the "
            "local and slurm backends do).",
            hint="On Ray, give Ray's own runtime environment an image (runtime_env={'image_uri': URL}, "
            "docs/containers.md), or run with a local profile.")

    return register(str(image["url"]), tag_policy=str(image.get("tag_policy") or "auto"),
                    credentials=image_credentials(image, secret_store))


__all__ = ["DockerImageSpec", "image_credentials", "prepare_image"]
