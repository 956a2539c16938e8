"""``deepspeed.utils.nvtx``: ``instrument_w_nvtx``, DeepSpeed 0.19.8's decorator marking a function's calls
as a profiler range (NVTX on CUDA) through the current accelerator's ``range_push``/``range_pop``.

``enable_nvtx``, ``get_accelerator`` and ``is_compiling`` are module attributes read at each call (as in
DeepSpeed, so they can be switched or replaced); under ``torch.compile`` tracing no range is opened (a graph
break otherwise). An accelerator with ``supports_nvtx_domain`` gets ``domain=DEEPSPEED_NVTX_DOMAIN``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from deepspeed.accelerator import get_accelerator

__all__ = ["DEEPSPEED_NVTX_DOMAIN", "enable_nvtx", "get_accelerator", "instrument_w_nvtx", "is_compiling"]

F = TypeVar("F", bound=Callable[..., Any])

enable_nvtx = True
DEEPSPEED_NVTX_DOMAIN = "DeepSpeed"


def is_compiling() -> bool:
    """Whether ``torch.compile`` is tracing the caller (``torch.compiler.is_compiling``)."""
    import torch

    return bool(torch.compiler.is_compiling())


def _push(accelerator: Any, message: str) -> None:
    if getattr(accelerator, "supports_nvtx_domain", False):
        accelerator.range_push(message, domain=DEEPSPEED_NVTX_DOMAIN)
    else:
        accelerator.range_push(message)


def _pop(accelerator: Any) -> None:
    if getattr(accelerator, "supports_nvtx_domain", False):
        accelerator.range_pop(domain=DEEPSPEED_NVTX_DOMAIN)
    else:
        accelerator.range_pop()


def instrument_w_nvtx(func: F) -> F:
    """Wrap ``func`` so each call runs inside a profiler range named ``func.__qualname__``.

    The range is closed when ``func`` raises too (DeepSpeed 0.19.8 leaves it open then, unbalancing the
    profiler's range stack); the wrapper keeps ``func``'s name and docstring (``functools.wraps``).
    """

    @functools.wraps(func)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        mark = enable_nvtx and not is_compiling()
        accelerator = get_accelerator() if mark else None
        if accelerator is not None:
            _push(accelerator, func.__qualname__)
        try:
            return func(*args, **kwargs)
        finally:
            if accelerator is not None:
                _pop(accelerator)

    return wrapped  # type: ignore[return-value]
