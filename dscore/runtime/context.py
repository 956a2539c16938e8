"""The current :class:`~dscore.runtime.runtime.Runtime`, held in a ``contextvars.ContextVar``.

Deep code (a ZeRO stage, an op, a checkpoint helper) reads the runtime that ``dscore.initialize`` made
current instead of a module-level singleton. A context variable follows ``asyncio`` tasks and
``contextvars.copy_context()``; a plain new thread starts without one (use ``use_runtime`` there).
This module imports neither torch nor any plugin; importing it points the collective facades built without a
registry at the current runtime's (:func:`dscore.comm.transports.set_registry_source`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from dscore.comm.transports import set_registry_source
from dscore.errors import DscoreError

if TYPE_CHECKING:
    from dscore.registry import Registry
    from dscore.runtime.runtime import Runtime

__all__ = ["current_runtime", "peek_runtime", "reset_runtime", "runtime_scoped", "set_runtime", "use_runtime"]

_CURRENT: contextvars.ContextVar[Runtime | None] = contextvars.ContextVar("dscore_runtime", default=None)


def current_runtime() -> Runtime:
    """The runtime made current by ``dscore.initialize`` (or :func:`use_runtime`).

    Raises:
        DscoreError: none is current; the message says how to make one.
    """
    runtime = _CURRENT.get()
    if runtime is None:
        raise DscoreError(
            "no dscore runtime is active in this context: call dscore.initialize(...) first, or wrap the code in "
            "`with dscore.runtime.context.use_runtime(runtime):` (new threads start without one)"
        )
    return runtime


def peek_runtime() -> Runtime | None:
    """The current runtime, or ``None`` when none is set (never raises)."""
    return _CURRENT.get()


def set_runtime(runtime: Runtime | None) -> contextvars.Token[Runtime | None]:
    """Make ``runtime`` current until :func:`reset_runtime` is given the returned token."""
    return _CURRENT.set(runtime)


def reset_runtime(token: contextvars.Token[Runtime | None]) -> None:
    """Restore the runtime that was current before the matching :func:`set_runtime`."""
    _CURRENT.reset(token)


@contextlib.contextmanager
def use_runtime(runtime: Runtime) -> Iterator[Runtime]:
    """Make ``runtime`` current inside the ``with`` block; the previous one is restored afterwards."""
    token = _CURRENT.set(runtime)
    try:
        yield runtime
    finally:
        _CURRENT.reset(token)


def _current_registry() -> Registry | None:
    runtime = _CURRENT.get()
    return runtime.registry if runtime is not None else None


# a collective facade built without a registry takes the current runtime's (comm sits below the runtime:
# it is told where to look instead of importing this module)
set_registry_source(_current_registry)

_F = TypeVar("_F", bound=Callable[..., Any])


def runtime_scoped(method: _F) -> _F:
    """Decorate a method of an object holding ``self.runtime`` so the call runs with that runtime current.

    The engine's ``forward``/``backward``/``step`` use it: deep code reached during training (an op built
    lazily, a ZeRO helper) then finds the engine's runtime — its registry (``plugins.disable`` holds), its
    accelerator and comm — instead of none, or another engine's.
    """

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        token = _CURRENT.set(self.runtime)
        try:
            return method(self, *args, **kwargs)
        finally:
            _CURRENT.reset(token)

    return wrapper  # type: ignore[return-value]
