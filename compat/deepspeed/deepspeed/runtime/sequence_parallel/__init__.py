"""``deepspeed.runtime.sequence_parallel``: Ulysses sequence parallelism, mapped onto :mod:`dscore.parallel`."""

from __future__ import annotations

from importlib import import_module
from typing import Any

__all__ = ["parallel_state_sp", "ulysses_sp"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return import_module(f"deepspeed.runtime.sequence_parallel.{name}")
    raise AttributeError(f"deepspeed.runtime.sequence_parallel.{name} is not provided by dscore's compatibility layer")
