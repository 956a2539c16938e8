"""``deepspeed.runtime.zero.config``: ``DeepSpeedZeroConfig`` (dscore's ``zero_optimization`` model: DeepSpeed
0.19.8's fields, defaults and ``stage3_*`` aliases; ``DeepSpeedZeroConfig(**ds_config["zero_optimization"])``
validates as dscore does), ``ZeroStageEnum`` and the offload names of :mod:`.offload_config`."""

from __future__ import annotations

from enum import IntEnum
from typing import Any

from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

__all__ = [
    "DeepSpeedZeroConfig",  # noqa: F822 - dscore's models, resolved on first access
    "DeepSpeedZeroOffloadOptimizerConfig",  # noqa: F822
    "DeepSpeedZeroOffloadParamConfig",  # noqa: F822
    "OffloadDeviceEnum",
    "OffloadStateTypeEnum",
    "ZeroStageEnum",
]


class ZeroStageEnum(IntEnum):
    """ZeRO stages by what they partition."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


def __getattr__(name: str) -> Any:
    if name == "DeepSpeedZeroConfig":
        from deepspeed.runtime._sections import section_model

        value = section_model("zero_optimization")
    elif name in ("DeepSpeedZeroOffloadParamConfig", "DeepSpeedZeroOffloadOptimizerConfig"):
        from deepspeed.runtime.zero import offload_config

        value = getattr(offload_config, name)
    else:
        raise AttributeError(f"deepspeed.runtime.zero.config.{name} is not provided by dscore's compatibility layer")
    globals()[name] = value
    return value
