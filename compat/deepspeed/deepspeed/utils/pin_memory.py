"""``deepspeed.utils.pin_memory``: DeepSpeed 0.19.8's native pinned-memory pool (``NativePinnedMemory``,
``get_native_pinned_memory``, ``get_active_native_pinned_memory``) imports and raises
:class:`deepspeed._not_provided.NotProvidedError` when used: dscore page-locks host buffers through its
accelerator (``get_accelerator().pin_memory(tensor)``) and keeps no pool of its own."""

from __future__ import annotations

from deepspeed._not_provided import refused_module_getattr

__getattr__ = refused_module_getattr(
    __name__, "dscore keeps no native pinned-memory pool; page-lock a host tensor with get_accelerator().pin_memory(t)"
)
