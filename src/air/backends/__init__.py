"""Backends: where a run's nodes run (`local`, `ray`, `slurm`). `backend_for` builds one from a profile, in
the one place that does."""

from __future__ import annotations

from typing import TYPE_CHECKING

from air.backends.base import Backend, SlotLedger

if TYPE_CHECKING:
    from air.config import Profile


def backend_for(profile: Profile, *, ledger: SlotLedger | None = None) -> Backend:
    """The backend of a profile (`air.config.Profile`). `ledger` is the slot ledger the local backend
    claims this machine's slots in (the run store); it is not needed to plan or check a shape."""
    if profile.backend == "server":
        from air.errors import UserInputError

        raise UserInputError(
            f"Profile {profile.name!r} sends runs to an air server ({profile.url}); this command runs here.",
            hint="Pick a local or ray profile with -p, or use a command that goes through the server.")
    if profile.backend == "ray":
        from air.backends.ray_backend import RayBackend

        backend = RayBackend.from_profile(profile)
        backend.ledger = ledger
        return backend
    if profile.backend == "slurm":
        from air.backends.slurm import SlurmBackend

        return SlurmBackend.from_profile(profile)
    from air.backends.local import LocalBackend

    return LocalBackend(ledger=ledger)


__all__ = ["Backend", "SlotLedger", "backend_for"]
