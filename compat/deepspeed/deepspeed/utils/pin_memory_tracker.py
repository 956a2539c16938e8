"""``deepspeed.utils.pin_memory_tracker``: DeepSpeed 0.19.8's pinned-memory accounting; its names import and
raise :class:`deepspeed._not_provided.NotProvidedError` when used: dscore page-locks host buffers through its
accelerator (``get_accelerator().pin_memory(tensor)``) and keeps no pool or tracker of its own."""

from __future__ import annotations

from deepspeed._not_provided import refused_module_getattr

__getattr__ = refused_module_getattr(
    __name__, "dscore keeps no pinned-memory tracker; page-lock a host tensor with get_accelerator().pin_memory(t)"
)
