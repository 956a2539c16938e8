"""``deepspeed.runtime.rollout.continuous_batching``: the slot scheduler (:mod:`dscore.rollout.continuous_batching`)."""

from __future__ import annotations

from dscore.rollout.continuous_batching import ContinuousBatchRequest, ContinuousBatchScheduler, ContinuousBatchUpdate

__all__ = ["ContinuousBatchRequest", "ContinuousBatchScheduler", "ContinuousBatchUpdate"]
