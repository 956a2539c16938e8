"""``deepspeed.runtime.zero.utils``: ``ZeRORuntimeException`` and ``is_zero_param``; DeepSpeed's other
internal helpers of this module import and raise :class:`deepspeed._not_provided.NotProvidedError` when used."""

from __future__ import annotations

from typing import Any

from deepspeed._not_provided import refused_module_getattr

__all__ = ["ZeRORuntimeException", "is_zero_param"]


class ZeRORuntimeException(Exception):
    """DeepSpeed's ZeRO runtime error type (dscore raises its own ``dscore.errors`` types)."""


def is_zero_param(parameter: Any) -> bool:
    """Whether ``parameter`` is partitioned by ZeRO stage 3 (:func:`dscore.zero.is_partitioned`)."""
    from dscore.zero import is_partitioned

    return bool(is_partitioned(parameter))


__getattr__ = refused_module_getattr(__name__, "a DeepSpeed ZeRO internal; dscore's ZeRO stages are plugin units")
