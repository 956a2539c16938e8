"""``deepspeed.runtime.rollout.hybrid_engine_rollout``: generation with the training engine's weights
(:mod:`dscore.rollout.hybrid_engine_rollout`)."""

from __future__ import annotations

from dscore.rollout.hybrid_engine_rollout import HybridEngineRollout, HybridEngineRolloutConfig

__all__ = ["HybridEngineRollout", "HybridEngineRolloutConfig"]
