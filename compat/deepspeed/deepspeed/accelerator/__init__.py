"""``deepspeed.accelerator``: DeepSpeed 0.19.8's accelerator API over dscore's accelerator plugins.

``get_accelerator()`` returns a :class:`~deepspeed.accelerator.abstract_accelerator.DeepSpeedAccelerator`
mapping one dscore accelerator (``dscore.accelerator``): inside an engine's calls the engine's runtime
accelerator, elsewhere the one dscore selects (``DS_ACCELERATOR`` / probing), chosen once per process.
``set_accelerator(obj)`` overrides it; ``is_current_accelerator_supported()`` says whether it is an
installed dscore accelerator. ``cpu_accelerator.CPU_Accelerator`` / ``cuda_accelerator.CUDA_Accelerator``
build the object for a named dscore accelerator.
"""

from __future__ import annotations

from deepspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator
from deepspeed.accelerator.real_accelerator import get_accelerator, is_current_accelerator_supported, set_accelerator

__all__ = ["DeepSpeedAccelerator", "get_accelerator", "is_current_accelerator_supported", "set_accelerator"]
