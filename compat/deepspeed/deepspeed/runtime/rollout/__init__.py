"""``deepspeed.runtime.rollout``: DeepSpeed 0.19.8's rollout API, mapped onto :mod:`dscore.rollout`."""

from __future__ import annotations

from dscore.rollout import (
    HybridEngineRollout,
    JSDLossOutput,
    ResponseTokenBatch,
    RolloutBatch,
    RolloutConfig,
    RolloutEngine,
    RolloutRequest,
    SamplingConfig,
    build_rollout,
    generalized_jsd_loss,
)

__all__ = [
    "HybridEngineRollout",
    "JSDLossOutput",
    "RolloutBatch",
    "RolloutConfig",
    "RolloutEngine",
    "RolloutRequest",
    "ResponseTokenBatch",
    "SamplingConfig",
    "build_rollout",
    "generalized_jsd_loss",
]
