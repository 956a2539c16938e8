"""``deepspeed.runtime.rollout.opsd``: response targets and the generalized JSD loss (:mod:`dscore.rollout.opsd`)."""

from __future__ import annotations

from dscore.rollout.opsd import JSDLossOutput, ResponseTokenBatch, generalized_jsd_loss

__all__ = ["JSDLossOutput", "ResponseTokenBatch", "generalized_jsd_loss"]
