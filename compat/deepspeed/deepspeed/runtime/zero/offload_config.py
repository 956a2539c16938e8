"""``deepspeed.runtime.zero.offload_config``: the offload enums and config models of DeepSpeed 0.19.8.

``OffloadDeviceEnum`` and ``OffloadStateTypeEnum`` are ``str`` enums with DeepSpeed's members and values, so
they compare equal to dscore's strings: ``engine.offload_states(include=[OffloadStateTypeEnum.optim_states],
device=OffloadDeviceEnum.cpu)`` (how OpenRLHF calls it) works on dscore's engine, and
``config.offload_param.device == OffloadDeviceEnum.cpu``. ``DeepSpeedZeroOffloadParamConfig`` /
``DeepSpeedZeroOffloadOptimizerConfig`` are dscore's models of ``zero_optimization.offload_param`` /
``offload_optimizer`` (same fields and defaults; ``device`` holds the plain string).
"""

from __future__ import annotations

from enum import Enum
from typing import Any

__all__ = [
    "DeepSpeedZeroOffloadOptimizerConfig",  # noqa: F822 - dscore's models, resolved on first access
    "DeepSpeedZeroOffloadParamConfig",  # noqa: F822
    "OffloadDeviceEnum",
    "OffloadStateTypeEnum",
]


class OffloadDeviceEnum(str, Enum):
    """Where ZeRO offloads to."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, Enum):
    """The training-state kinds ``engine.offload_states(include=...)`` moves."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


_MODELS = {"DeepSpeedZeroOffloadParamConfig": "offload_param", "DeepSpeedZeroOffloadOptimizerConfig": "offload_optimizer"}


def __getattr__(name: str) -> Any:
    if name in _MODELS:
        from deepspeed.runtime._sections import field_model

        value = field_model("zero_optimization", _MODELS[name])
        globals()[name] = value
        return value
    raise AttributeError(f"deepspeed.runtime.zero.offload_config.{name} is not provided by dscore's compatibility layer")
