"""``deepspeed.runtime``: the engine, base optimizer, LR-schedule and sequence-parallel names, mapped onto dscore."""

from __future__ import annotations

from importlib import import_module
from typing import Any

__all__ = ["base_optimizer", "config", "engine", "lr_schedules", "precision_config", "sequence_parallel", "utils", "zero"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return import_module(f"deepspeed.runtime.{name}")
    raise AttributeError(f"deepspeed.runtime.{name} is not provided by dscore's compatibility layer")
