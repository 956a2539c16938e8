"""``deepspeed.runtime.rollout.base``: the rollout data classes and contract (:mod:`dscore.rollout.base`)."""

from __future__ import annotations

from dscore.rollout.base import RolloutBatch, RolloutConfig, RolloutEngine, RolloutRequest, SamplingConfig

__all__ = ["RolloutBatch", "RolloutConfig", "RolloutEngine", "RolloutRequest", "SamplingConfig"]
