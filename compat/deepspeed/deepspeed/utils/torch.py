"""``deepspeed.utils.torch``: DeepSpeed 0.19.8's torch-version and hook helpers.

``required_torch_version(min_version=None, max_version=None)`` compares the installed torch's version
(PEP 440, so ``2.13.0+cpu`` counts as ``2.13.0``) with inclusive bounds; ``register_grad_hook(param, hook)``
runs ``hook(param)`` once ``param.grad`` has been accumulated; ``is_functorch_transforming()`` says whether
the caller runs under a ``torch.func`` transform; ``jit_script_compat(fn)`` compiles ``fn`` with
``torch.compile``, else ``torch.jit.script``, else returns it unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from packaging.version import Version

__all__ = ["is_functorch_transforming", "jit_script_compat", "register_grad_hook", "required_torch_version"]

logger = logging.getLogger("deepspeed.utils.torch")


def required_torch_version(min_version: float | str | None = None, max_version: float | str | None = None) -> bool:
    """True when ``min_version <= torch.__version__ <= max_version`` (either bound may be left out).

    Bounds may be numbers (``2.1``) or strings (``"2.1.0"``); local tags of the installed torch (``+cpu``)
    are ignored. Raises:
        ValueError: neither bound is given (DeepSpeed asserts), or a bound is not a version.
    """
    if not min_version and not max_version:
        raise ValueError("required_torch_version: give min_version or max_version")
    installed = Version(Version(torch.__version__).base_version)
    if min_version and Version(str(min_version)) > installed:
        return False
    return not (max_version and Version(str(max_version)) < installed)


def is_functorch_transforming() -> bool:
    """True when called under ``torch.func.grad`` / ``vmap`` / ``jacrev`` / ... (functorch's interpreter
    stack is not empty); False where this torch has no such stack."""
    functorch = getattr(torch._C, "_functorch", None)
    peek = getattr(functorch, "peek_interpreter_stack", None)
    return peek is not None and peek() is not None


def register_grad_hook(param: torch.Tensor, hook: Callable[[torch.Tensor], Any]) -> Any:
    """Run ``hook(param)`` each time ``param.grad`` has been accumulated; returns the removable handle
    (``Tensor.register_post_accumulate_grad_hook``, torch >= 2.1, which dscore requires)."""
    return param.register_post_accumulate_grad_hook(hook)


def jit_script_compat(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compile(fn)`` (lazy: compiled on first call), else ``torch.jit.script(fn)`` when
    ``torch.compile`` refuses it, else ``fn`` itself (logged at DEBUG)."""
    try:
        return torch.compile(fn)
    except Exception:  # noqa: BLE001 - fall back as DeepSpeed does
        logger.debug("torch.compile refused %r; trying torch.jit.script", fn, exc_info=True)
    try:
        return torch.jit.script(fn)
    except Exception:  # noqa: BLE001
        logger.debug("torch.jit.script refused %r; using it uncompiled", fn, exc_info=True)
        return fn
