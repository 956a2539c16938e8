"""``deepspeed.runtime.zero``: the ZeRO helpers of :mod:`deepspeed.zero` (``Init``, ``GatheredParameters``,
``register_external_parameter``), ``ZeroParamStatus``, ``unwrap_model_for_generation`` (:mod:`.stage3`) and the
submodules (``config``, ``offload_config``, ``partition_parameters``, ``stage3``, ``stage_1_and_2``, ``tiling``,
``linear``, ``utils``, ``leaf_module_config``, ``parameter_offload``, ``offload_states``), imported on first use.
``TiledLinear`` / ``TiledLinearReturnBias`` are :mod:`.tiling`'s (not provided by dscore)."""

from __future__ import annotations

from importlib import import_module
from typing import Any

from deepspeed.zero import GatheredParameters, Init, register_external_parameter

_SUBMODULES = ("config", "leaf_module_config", "linear", "offload_config", "offload_states", "parameter_offload",
               "partition_parameters", "stage3", "stage_1_and_2", "tiling", "utils")
_FROM = {"ZeroParamStatus": "partition_parameters", "unwrap_model_for_generation": "stage3",
         "TiledLinear": "tiling", "TiledLinearReturnBias": "tiling"}

__all__ = ["GatheredParameters", "Init", "register_external_parameter", *_SUBMODULES, *_FROM]  # noqa: F822


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return import_module(f"deepspeed.runtime.zero.{name}")
    if name in _FROM:
        value = getattr(import_module(f"deepspeed.runtime.zero.{_FROM[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"deepspeed.runtime.zero.{name} is not provided by dscore's compatibility layer")
