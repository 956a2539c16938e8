"""On-policy rollouts for RL and distillation inside the training engine (DeepSpeed 0.19.8's rollout API).

* :class:`RolloutRequest` (left-padded prompts in), :class:`RolloutBatch` (prompt + response out),
  :class:`SamplingConfig`, :class:`RolloutConfig`, the :class:`RolloutEngine` contract (:mod:`.base`);
* :class:`HybridEngineRollout`: generation with the training engine's own weights (:mod:`.hybrid_engine_rollout`);
* :class:`ResponseTokenBatch` and :func:`generalized_jsd_loss` for on-policy distillation (:mod:`.opsd`);
* :func:`build_rollout`: the engine named by ``RolloutConfig.engine``;
* :class:`WeightSyncGroup`, :class:`WeightSyncSender`, :class:`WeightSyncReceiver`: dscore's own weight sync from
  the training ranks to separate generation processes (:mod:`.weight_sync`; not a DeepSpeed name).

``deepspeed.runtime.rollout`` of the compatibility distribution is these names. Importing this package imports
torch.
"""

from __future__ import annotations

from typing import Any

from dscore.errors import RolloutError
from dscore.rollout.base import RolloutBatch, RolloutConfig, RolloutEngine, RolloutRequest, SamplingConfig
from dscore.rollout.hybrid_engine_rollout import HybridEngineRollout, HybridEngineRolloutConfig
from dscore.rollout.opsd import JSDLossOutput, ResponseTokenBatch, generalized_jsd_loss
from dscore.rollout.weight_sync import WeightSyncGroup, WeightSyncReceiver, WeightSyncSender

__all__ = [
    "HybridEngineRollout",
    "HybridEngineRolloutConfig",
    "JSDLossOutput",
    "RolloutBatch",
    "RolloutConfig",
    "RolloutEngine",
    "RolloutRequest",
    "ResponseTokenBatch",
    "SamplingConfig",
    "WeightSyncGroup",
    "WeightSyncReceiver",
    "WeightSyncSender",
    "build_rollout",
    "generalized_jsd_loss",
]


def build_rollout(rollout_cfg: Any, student_engine: Any = None, tokenizer: Any = None, **kwargs: Any) -> RolloutEngine:
    """The rollout engine ``rollout_cfg.engine`` names (only ``"hybrid_engine"``).

    Args:
        rollout_cfg: a :class:`RolloutConfig` (anything with ``engine``; passed on as the rollout's ``cfg``).
        student_engine: the training engine whose model generates.
        tokenizer: the model's tokenizer (``pad_token_id`` / ``eos_token_id``).
        kwargs: accepted for DeepSpeed's signature; none is read, so any given is an error.

    Raises:
        RolloutError: an unknown engine name, a missing engine or tokenizer, or extra keyword arguments.
    """
    if kwargs:
        raise RolloutError(f"build_rollout: unexpected keyword arguments {sorted(kwargs)}")
    name = getattr(rollout_cfg, "engine", None)
    if name == "hybrid_engine":
        if student_engine is None or tokenizer is None:
            raise RolloutError("build_rollout: the hybrid_engine rollout needs both student_engine and tokenizer")
        return HybridEngineRollout(engine=student_engine, tokenizer=tokenizer, cfg=rollout_cfg)
    raise RolloutError(f"build_rollout: unknown rollout engine {name!r}; choose from 'hybrid_engine'")
