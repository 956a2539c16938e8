"""``deepspeed.ops.lion.DeepSpeedCPULion``: dscore's registered optimizer of that name (see :mod:`deepspeed.ops`)."""

from __future__ import annotations

from typing import Any

__all__ = ["DeepSpeedCPULion"]  # noqa: F822 - resolved on first access by __getattr__ (reads the plugin registry)


def __getattr__(name: str) -> Any:
    if name == "DeepSpeedCPULion":
        from deepspeed.ops import registered_optimizer_class

        cls = registered_optimizer_class(name)
        globals()[name] = cls
        return cls
    raise AttributeError(f"deepspeed.ops.lion.{name} is not provided by dscore's compatibility layer")
