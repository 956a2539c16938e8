"""``deepspeed.runtime.zero``: ``partition_parameters`` and the ZeRO helpers of :mod:`deepspeed.zero`."""

from __future__ import annotations

from deepspeed.zero import GatheredParameters, Init, register_external_parameter

__all__ = ["GatheredParameters", "Init", "partition_parameters", "register_external_parameter"]


def __getattr__(name: str) -> object:
    if name == "partition_parameters":
        from importlib import import_module

        return import_module("deepspeed.runtime.zero.partition_parameters")
    raise AttributeError(f"deepspeed.runtime.zero.{name} is not provided by dscore's compatibility layer")
