"""``deepspeed.compile.util``: ``is_deepcompile_supported()`` is False (dscore has no DeepCompile); DeepSpeed
0.19.8's other helpers here are DeepCompile graph utilities, not provided (see :mod:`deepspeed.compile`)."""

from __future__ import annotations

from deepspeed._not_provided import refused_module_getattr
from deepspeed.compile import REASON

__all__ = ["is_deepcompile_supported"]


def is_deepcompile_supported() -> bool:
    """False: dscore does not implement DeepCompile, whatever torch and the accelerator are (DeepSpeed's
    answer is torch >= 2.6 on CUDA)."""
    return False


__getattr__ = refused_module_getattr(__name__, REASON)
