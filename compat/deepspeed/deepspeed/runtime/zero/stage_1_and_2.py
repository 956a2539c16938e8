"""``deepspeed.runtime.zero.stage_1_and_2``: DeepSpeed 0.19.8's ZeRO-2 memory estimators (dscore's,
:mod:`dscore.zero.estimate`). ``DeepSpeedZeroOptimizer`` (DeepSpeed's stage 1/2 optimizer class) is not
provided: dscore's stages are the ``zero_stage:stage1`` / ``stage2`` plugin units (``engine.zero_stage_impl``);
``isinstance(engine.optimizer, DeepSpeedZeroOptimizer)`` is True at ZeRO stages 1 and 2, as client code checks it."""

from __future__ import annotations

from typing import Any

from deepspeed._not_provided import zero_optimizer_class
from dscore.zero.estimate import (
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
    model_params_for_estimate,
)

__all__ = [
    "DeepSpeedZeroOptimizer",
    "estimate_zero2_model_states_mem_needs",
    "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero2_model_states_mem_needs_all_live",
    "model_to_params",
]

DeepSpeedZeroOptimizer = zero_optimizer_class(
    "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer",
    (1, 2),
    "dscore's ZeRO stages 1 and 2 are the zero_stage:stage1/stage2 plugin units (engine.zero_stage_impl); build "
    "them with deepspeed.initialize and a zero_optimization.stage 1 or 2 config",
)


def model_to_params(model: Any) -> int:
    """The number of parameters of ``model`` (shared parameters counted once)."""
    return model_params_for_estimate(model)[0]
