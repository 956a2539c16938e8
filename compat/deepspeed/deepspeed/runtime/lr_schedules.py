"""``deepspeed.runtime.lr_schedules``: ``VALID_LR_SCHEDULES``, the names of the LR schedules a ds_config may
select (``scheduler.type``), read from dscore's plugin registry (its ``torch`` fall-back excluded, as DeepSpeed
lists only its own)."""

from __future__ import annotations

from typing import Any

__all__ = ["VALID_LR_SCHEDULES"]  # noqa: F822 - resolved on first access by __getattr__ (reads the plugin registry)


def _names() -> list[str]:
    from dscore.plugin_manager import create_plugin_manager
    from dscore.registry import Registry

    registry = Registry(create_plugin_manager())
    return [spec.name for spec in registry.specs("lr_scheduler") if spec.name != "torch"]


def __getattr__(name: str) -> Any:
    if name == "VALID_LR_SCHEDULES":
        value = _names()
        globals()[name] = value
        return value
    raise AttributeError(f"deepspeed.runtime.lr_schedules.{name} is not provided by dscore's compatibility layer")
