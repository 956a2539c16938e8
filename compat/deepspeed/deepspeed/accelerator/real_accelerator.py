"""``get_accelerator()``, ``set_accelerator(obj)``, ``is_current_accelerator_supported()`` over dscore's
accelerator selection (see :mod:`deepspeed.accelerator`)."""

from __future__ import annotations

import functools
import weakref
from typing import Any

from deepspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator
from dscore.errors import AcceleratorError

__all__ = ["get_accelerator", "is_current_accelerator_supported", "set_accelerator"]

_override: DeepSpeedAccelerator | None = None
# one DeepSpeedAccelerator per dscore accelerator, so state set on it (the compile backend) stays
_views: weakref.WeakKeyDictionary[Any, DeepSpeedAccelerator] = weakref.WeakKeyDictionary()


@functools.lru_cache(maxsize=1)
def _selected() -> Any:
    from dscore.accelerator import select_accelerator
    from dscore.plugin_manager import create_plugin_manager
    from dscore.registry import Registry

    accelerator, _reason = select_accelerator(Registry(create_plugin_manager()))
    return accelerator


def _view(accelerator: Any) -> DeepSpeedAccelerator:
    view = _views.get(accelerator)
    if view is None:
        view = _views[accelerator] = DeepSpeedAccelerator(accelerator)
    return view


def get_accelerator() -> DeepSpeedAccelerator:
    """The accelerator object (DeepSpeed 0.19.8's API, :class:`DeepSpeedAccelerator`).

    The one :func:`set_accelerator` set, else — inside an engine's calls — the engine's runtime accelerator,
    else the one dscore selects from its installed accelerator plugins (``DS_ACCELERATOR`` / probing), chosen
    once per process as DeepSpeed does.

    Raises:
        AcceleratorError: ``DS_ACCELERATOR`` names no installed or no usable accelerator (dscore's message).
    """
    if _override is not None:
        return _override
    from dscore.runtime.context import peek_runtime

    runtime = peek_runtime()
    return _view(runtime.accelerator if runtime is not None else _selected())


def set_accelerator(accel_obj: DeepSpeedAccelerator | None) -> None:
    """Make ``accel_obj`` what :func:`get_accelerator` returns from now on (``None``: back to selection).

    It changes this process's ``deepspeed.accelerator`` answer only: an engine keeps the accelerator its
    runtime selected (the config's ``accelerator`` key or ``DS_ACCELERATOR``).

    Raises:
        AcceleratorError: ``accel_obj`` is not a :class:`DeepSpeedAccelerator` (e.g.
            ``deepspeed.accelerator.cpu_accelerator.CPU_Accelerator()``) or ``None``.
    """
    global _override
    if accel_obj is not None and not isinstance(accel_obj, DeepSpeedAccelerator):
        raise AcceleratorError(
            f"set_accelerator({type(accel_obj).__name__}): expected a "
            "deepspeed.accelerator.abstract_accelerator.DeepSpeedAccelerator (e.g. "
            "deepspeed.accelerator.cpu_accelerator.CPU_Accelerator()) or None"
        )
    _override = accel_obj


def is_current_accelerator_supported() -> bool:
    """True when :func:`get_accelerator`'s accelerator is one of the active registry's accelerator plugins
    (DeepSpeed's rule is membership in its built-in list; dscore's list is its installed plugins)."""
    from dscore.exports import active_registry

    registry, _ = active_registry()
    return get_accelerator()._name in registry.names("accelerator")
