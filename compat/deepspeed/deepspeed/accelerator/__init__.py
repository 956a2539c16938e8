"""``deepspeed.accelerator.get_accelerator()``: dscore's accelerator (``dscore.accelerator``).

Inside an engine's calls it is the engine's runtime accelerator; elsewhere the one dscore selects from its
installed accelerator plugins (``DS_ACCELERATOR`` / probing), chosen once per process as DeepSpeed does.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["get_accelerator"]


@functools.lru_cache(maxsize=1)
def _selected() -> Any:
    from dscore.accelerator import select_accelerator
    from dscore.plugin_manager import create_plugin_manager
    from dscore.registry import Registry

    accelerator, _reason = select_accelerator(Registry(create_plugin_manager()))
    return accelerator


def get_accelerator() -> Any:
    """The accelerator object (``device_name(i)``, ``current_device_name()``, ``communication_backend_name()``,
    ``synchronize()``, ``empty_cache()``, memory and RNG methods; see :class:`dscore.accelerator.Accelerator`)."""
    from dscore.runtime.context import peek_runtime

    runtime = peek_runtime()
    if runtime is not None:
        return runtime.accelerator
    return _selected()
