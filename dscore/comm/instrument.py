"""Instrumenting the collectives of :class:`dscore.comm.Comm`: the hook point a plugin wraps them through.

A plugin that observes collectives (the comm plugin's comms logger: count, size, latency, bandwidth)
registers a *wrapper* with :func:`wrap_collectives`; the facade class is declared instrumentable
(:func:`instrumentable`), so each registered wrapper replaces each of its :data:`COLLECTIVES` by
``wrapper(name, method)`` (a function taking the facade as its first argument), whichever of the two
happens first. Wrappers apply to every facade, bound ones included, for the rest of the process, in the
order they were registered (a later one wraps an earlier one). A wrapper should cost next to nothing
while it records nothing (one attribute test).

This module imports neither torch nor any plugin.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["COLLECTIVES", "CollectiveWrapper", "instrumentable", "wrap_collectives", "wrappers"]

#: the methods of the facade a wrapper receives (collectives and point-to-point transfers)
COLLECTIVES: frozenset[str] = frozenset(
    {
        "all_reduce",
        "reduce_scatter_tensor",
        "reduce_scatter",
        "all_gather_into_tensor",
        "all_gather",
        "broadcast",
        "all_to_all_single",
        "all_to_all",
        "reduce",
        "gather",
        "scatter",
        "all_reduce_coalesced",
        "all_gather_coalesced",
        "send",
        "recv",
        "isend",
        "irecv",
        "batch_isend_irecv",
        "barrier",
        "monitored_barrier",
    }
)

#: ``wrapper(name, method) -> replacement``: ``method`` is the facade's function ``name`` (unbound)
CollectiveWrapper = Callable[[str, Callable[..., Any]], Callable[..., Any]]

_C = TypeVar("_C", bound=type)

_wrappers: list[CollectiveWrapper] = []
_targets: list[type] = []
_lock = threading.Lock()


def _apply(cls: type, wrapper: CollectiveWrapper) -> None:
    for name in sorted(COLLECTIVES):
        method = cls.__dict__.get(name)
        if method is not None:
            setattr(cls, name, wrapper(name, method))


def wrap_collectives(wrapper: CollectiveWrapper) -> None:
    """Register ``wrapper`` for the :data:`COLLECTIVES` of every instrumentable class (now and later).
    Registering the same wrapper again does nothing."""
    with _lock:
        if any(w is wrapper for w in _wrappers):
            return
        _wrappers.append(wrapper)
        for cls in _targets:
            _apply(cls, wrapper)


def instrumentable(cls: _C) -> _C:
    """Declare ``cls`` (the facade) instrumentable: the wrappers registered so far apply now, later ones
    when registered. Returns ``cls``."""
    with _lock:
        if cls not in _targets:
            _targets.append(cls)
            for wrapper in _wrappers:
                _apply(cls, wrapper)
    return cls


def wrappers() -> tuple[CollectiveWrapper, ...]:
    """The registered wrappers, in registration order."""
    with _lock:
        return tuple(_wrappers)
