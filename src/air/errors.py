"""Every error air raises on purpose, in one place.

Two families, as in the hosted product: *user* errors (bad input the user can fix: exit code 2 in the
CLI) and *runtime* errors (a run or a rank failed, infrastructure broke: exit code 1). Every error that
crosses a process boundary must pickle; `tests/test_errors.py` round-trips them.
"""

from __future__ import annotations


class AirError(Exception):
    """Base of all air errors. `hint` is the next thing the user should do, shown after the message."""

    exit_code: int = 1
    kind: str = "INTERNAL"
    code: str = "INTERNAL_ERROR"

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __reduce__(self) -> tuple[object, ...]:  # keep `hint` across pickling
        return (_rebuild, (type(self), self.message, self.hint, dict(self.__dict__)))

    def __str__(self) -> str:
        return f"{self.message}\n{self.hint}" if self.hint else self.message


def _rebuild(cls: type[AirError], message: str, hint: str | None, state: dict[str, object]) -> AirError:
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    err.__dict__.update(state)
    err.message, err.hint = message, hint
    return err


# ---- user errors (exit 2) -------------------------------------------------------------------------


class UserInputError(AirError):
    """Invalid input: a YAML field, an argument, a setting. Nothing was started or written."""

    exit_code = 2
    kind = "USER"
    code = "INVALID_REQUEST"


class RuntimeConfigurationError(UserInputError):
    """The decorator or a runtime helper was used the wrong way."""


class GPUValidationError(UserInputError):
    """More accelerators than the machine (or backend) can ever give, or a wrong count for the shape."""


class GPUTypeError(UserInputError):
    """An accelerator type that does not exist or does not match this machine."""


class SerializationError(UserInputError):
    """A function, argument or return value that cannot be pickled."""


class NotFoundError(AirError):
    """A run, attempt or log that does not exist."""

    exit_code = 2
    kind = "NOT_FOUND"
    code = "NOT_FOUND"


# ---- runtime errors (exit 1) ----------------------------------------------------------------------


class LaunchError(AirError):
    """Processes could not be started (not the user's code failing)."""


class RankFailedError(AirError):
    """A rank failed without a Python exception we could bring back (exit code, signal, lost outcome).

    Also wraps a rank's exception whose type cannot be rebuilt in the caller.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        exit_code: int | None = None,
        signal_name: str | None = None,
        remote_traceback: str | None = None,
        exception_type: str | None = None,
        log_path: str | None = None,
        log_tail: str | None = None,
        hint: str | None = None,
    ) -> None:
        super().__init__(message, hint=hint)
        self.rank = rank
        self.returncode = exit_code
        self.signal_name = signal_name
        self.remote_traceback = remote_traceback
        self.exception_type = exception_type
        self.log_path = log_path
        self.log_tail = log_tail


class LocalExecutionTimeoutError(AirError):
    """A local `@distributed` call ran past its `timeout`; every rank was ended."""

    code = "TIMEDOUT"


class HangError(AirError):
    """A rank (or node) made no progress for `hang_timeout`: no line, heartbeat or report. Every rank
    was ended after their stacks were saved; `stacks` holds the silent rank's."""

    code = "HANG"

    def __init__(self, message: str, *, rank: int | None = None, node: int | None = None,
                 silent_s: float | None = None, stacks: str | None = None, stacks_path: str | None = None,
                 hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.rank = rank
        self.node = node
        self.silent_s = silent_s
        self.stacks = stacks
        self.stacks_path = stacks_path


class WorkloadFailureException(AirError):
    """A remote run ended without results (failed, canceled, timed out)."""


class BackendUnavailableError(AirError):
    """The configured backend (e.g. a Ray cluster) cannot be reached or is not configured."""

    kind = "TRANSIENT"
    code = "NETWORK_ERROR"


class RayInitializationError(AirError):
    """A Ray cluster for `ray_launch` could not be started."""


class EnvironmentBuildError(AirError):
    """`environment.dependencies` could not be installed."""


class StoreError(AirError):
    """The run store (`runs.db`) cannot be used as it is: corrupt, unwritable, locked, or emptied beside
    run folders. The message names the file and what is wrong; the hint says what to do."""

    code = "STORE_ERROR"


class SecretMaskingError(AirError):
    """A run's logs cannot be shown safely: a secret it was given can no longer be resolved, so its value
    could not be hidden. Nothing was printed (exit 1: the request was fine, the state is not)."""

    code = "SECRET_UNRESOLVABLE"


__all__ = [
    "AirError",
    "BackendUnavailableError",
    "EnvironmentBuildError",
    "GPUTypeError",
    "GPUValidationError",
    "HangError",
    "LaunchError",
    "LocalExecutionTimeoutError",
    "NotFoundError",
    "RankFailedError",
    "RayInitializationError",
    "SecretMaskingError",
    "RuntimeConfigurationError",
    "SerializationError",
    "StoreError",
    "UserInputError",
    "WorkloadFailureException",
]
