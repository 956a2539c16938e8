"""``deepspeed.ops.lion``: ``DeepSpeedCPULion``, ``FusedLion``: dscore's registered optimizers of those names
(resolved through the optimizer registry on first access, see :mod:`deepspeed.ops`)."""

from __future__ import annotations

from typing import Any

__all__ = ["DeepSpeedCPULion", "FusedLion"]  # noqa: F822 - the registry's classes resolve on first access (__getattr__)

_REGISTERED = ("DeepSpeedCPULion", "FusedLion")


def __getattr__(name: str) -> Any:
    if name in _REGISTERED:
        from deepspeed.ops import registered_optimizer_class

        cls = registered_optimizer_class(name)
        globals()[name] = cls
        return cls
    raise AttributeError(f"deepspeed.ops.lion.{name} is not provided by dscore's compatibility layer")
