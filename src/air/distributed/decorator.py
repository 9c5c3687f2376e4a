"""`@distributed`: run a function once per accelerator and get every rank's return value back."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Generic, ParamSpec, TypeVar, overload

from air.constants import DEFAULT_DISTRIBUTED_TIMEOUT_S
from air.distributed.shape import UNSET, CallSettings, check_settings
from air.distributed.world_of_one import run_as_world_of_one
from air.errors import AirError, RuntimeConfigurationError

P = ParamSpec("P")
R = TypeVar("R")


class DistributedFunction(Generic[P, R]):
    """A function bound to a shape. Call `.distributed(...)` to run it on every rank, `.func(...)` to
    run it once here (as rank 0 of a world of one), `.raw_func` is the undecorated function itself."""

    def __init__(self, func: Callable[P, R], settings: CallSettings) -> None:
        if not callable(func):
            raise RuntimeConfigurationError(f"@distributed decorates a function, got {func!r}.")
        self.raw_func = func
        self.func: Callable[P, R] = run_as_world_of_one(func)
        self._settings = settings
        functools.update_wrapper(self, func)

    # -- the settings, under both spellings ---------------------------------------------------------
    @property
    def num_accelerators(self) -> int | None:
        return self._settings.num_accelerators

    @property
    def accelerator_type(self) -> str | None:
        return self._settings.accelerator_type

    gpus = num_accelerators
    gpu_type = accelerator_type

    @property
    def remote(self) -> bool:
        return self._settings.remote

    @property
    def timeout(self) -> float | None:
        return self._settings.timeout

    @property
    def hang_timeout(self) -> float | None:
        return self._settings.hang_timeout

    def __repr__(self) -> str:
        s = self._settings
        return (f"DistributedFunction(num_accelerators={s.num_accelerators!r}, accelerator_type="
                f"{s.accelerator_type!r}, remote={s.remote!r}, timeout={s.timeout!r}, "
                f"func={getattr(self.raw_func, '__qualname__', self.raw_func)!s})")

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        name = getattr(self.raw_func, "__name__", "fn")
        raise RuntimeConfigurationError(
            f"{name}() is decorated with @distributed and is not called directly.",
            hint=f"Use {name}.distributed(...) to run it on every accelerator and get a list of results, or "
            f"{name}.func(...) to run the plain function once in this process.",
        )

    def with_overrides(self, num_accelerators: int | None = None, accelerator_type: str | None = None,
                       remote: bool | None = None, timeout: float | None | object = UNSET, *,
                       gpus: int | None = None, gpu_type: str | None = None,
                       hang_timeout: float | None | object = UNSET) -> DistributedFunction[P, R]:
        """A copy with some settings changed (re-validated); `timeout=None` (`hang_timeout=None`) disables it."""
        s = self._settings
        if num_accelerators is None and gpus is None:
            num_accelerators = s.num_accelerators
        if accelerator_type is None and gpu_type is None:
            accelerator_type = s.accelerator_type
        settings = check_settings(num_accelerators, accelerator_type, s.remote if remote is None else remote,
                                  s.timeout if timeout is UNSET else timeout, gpus, gpu_type,
                                  hang_timeout=s.hang_timeout if hang_timeout is UNSET else hang_timeout)
        return DistributedFunction(self.raw_func, settings)

    def _bind(self, args: tuple[object, ...], kwargs: dict[str, object]) -> tuple[tuple[object, ...], dict[str, object]]:
        try:
            bound = inspect.signature(self.raw_func).bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{getattr(self.raw_func, '__name__', 'fn')}.distributed(): {exc}") from None
        except ValueError:
            return args, kwargs
        bound.apply_defaults()
        return bound.args, bound.kwargs

    def distributed(self, *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """Run on every rank and block; returns one value per rank, ordered by global rank."""
        call_args, call_kwargs = self._bind(args, kwargs)
        try:
            if self._settings.remote:
                from air.distributed.remote import run_remote

                return run_remote(self.raw_func, call_args, call_kwargs, self._settings)
            from air.distributed.local import run_local

            return run_local(self.raw_func, call_args, call_kwargs, self._settings)
        except Exception as exc:
            if isinstance(exc, AirError) or hasattr(exc, "air_rank"):
                # Lead with the root cause: the rank's traceback (its __cause__), not air's own frames.
                raise exc.with_traceback(None) from exc.__cause__
            raise


@overload
def distributed(func: Callable[P, R], /) -> DistributedFunction[P, R]: ...


@overload
def distributed(num_accelerators: int | None = None, accelerator_type: str | None = None, remote: bool = False,
                timeout: float | None = DEFAULT_DISTRIBUTED_TIMEOUT_S, *, gpus: int | None = None,
                gpu_type: str | None = None, hang_timeout: float | None = None,
                ) -> Callable[[Callable[P, R]], DistributedFunction[P, R]]: ...


def distributed(num_accelerators: object = None, accelerator_type: object = None, remote: object = False,
                timeout: object = DEFAULT_DISTRIBUTED_TIMEOUT_S, *, gpus: object = None, gpu_type: object = None,
                hang_timeout: object = None) -> object:
    """Decorate a function to run once per accelerator: `@distributed(gpus=8, gpu_type="H100")`.

    `num_accelerators`/`gpus`: how many ranks (default: every GPU of this machine).
    `accelerator_type`/`gpu_type`: 'H100', 'A10', 'GPU_8xH100', … or 'CPU' (gloo, no GPU needed).
    `remote`: submit to the configured backend (profile) instead of this machine's accelerators.
    `timeout`: seconds before every rank is ended (local calls; None disables).
    `hang_timeout`: seconds a rank may go without progress (no line printed, no `air.runtime.heartbeat()`)
    before every rank's stacks are saved, every rank is ended and the call raises `HangError` (None: off).
    """
    if callable(num_accelerators) and not isinstance(num_accelerators, (int, bool)):
        return DistributedFunction(num_accelerators, check_settings(timeout=DEFAULT_DISTRIBUTED_TIMEOUT_S))
    settings = check_settings(num_accelerators, accelerator_type, remote, timeout, gpus, gpu_type,
                              hang_timeout=hang_timeout)

    def wrap(func: Callable[P, R]) -> DistributedFunction[P, R]:
        return DistributedFunction(func, settings)

    return wrap
