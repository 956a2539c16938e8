"""``deepspeed.ops.adam``: ``DeepSpeedCPUAdam``, ``FusedAdam``: dscore's registered optimizers of those names
(resolved through the optimizer registry on first access, see :mod:`deepspeed.ops`).
``ZenFlowSelectiveAdamW``, ``ZenFlowSelectiveAdamW_stage3``: importable, refused when used (not provided by dscore)."""

from __future__ import annotations

from typing import Any

from deepspeed._not_provided import not_provided

ZenFlowSelectiveAdamW = not_provided("deepspeed.ops.adam.ZenFlowSelectiveAdamW", "ZenFlow is not implemented by dscore (its config keys are refused); use DeepSpeedCPUAdam or FusedAdam")
ZenFlowSelectiveAdamW_stage3 = not_provided("deepspeed.ops.adam.ZenFlowSelectiveAdamW_stage3", "ZenFlow is not implemented by dscore (its config keys are refused); use DeepSpeedCPUAdam or FusedAdam")

__all__ = ["DeepSpeedCPUAdam", "FusedAdam", "ZenFlowSelectiveAdamW", "ZenFlowSelectiveAdamW_stage3"]  # noqa: F822 - the registry's classes resolve on first access (__getattr__)

_REGISTERED = ("DeepSpeedCPUAdam", "FusedAdam")


def __getattr__(name: str) -> Any:
    if name in _REGISTERED:
        from deepspeed.ops import registered_optimizer_class

        cls = registered_optimizer_class(name)
        globals()[name] = cls
        return cls
    raise AttributeError(f"deepspeed.ops.adam.{name} is not provided by dscore's compatibility layer")
