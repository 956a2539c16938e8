"""The accelerator object for one named dscore accelerator (``CPU_Accelerator()``, ``CUDA_Accelerator()``)."""

from __future__ import annotations

from typing import Any


def named_accelerator(name: str) -> Any:
    """A new instance of the dscore accelerator plugin ``name``, as ``DS_ACCELERATOR=name`` would select it.

    Raises:
        AcceleratorError: no installed accelerator is called ``name``, or it is not usable here (dscore's
            message, with the probe's reason and what is usable).
    """
    from dscore.accelerator import select_accelerator
    from dscore.exports import active_registry

    registry, _ = active_registry()
    accelerator, _reason = select_accelerator(registry, requested=name)
    return accelerator
