"""Manifest of the built-in MoE plugin: at engine creation every :class:`dscore.moe.layer.MoE` of the
model gets its expert-parallel group (DeepSpeed's engine calls ``set_deepspeed_parallelism`` the same
way); ``engine.has_moe_layers`` / ``engine.num_experts`` are set as DeepSpeed's engine sets them."""

from __future__ import annotations

from typing import Any

from dscore import hookimpl

__all__ = ["dscore_engine_created"]


@hookimpl
def dscore_engine_created(engine: Any) -> None:
    """Give each MoE layer its expert groups over the engine's data-parallel comm (collective)."""
    from dscore.moe.layer import MoE

    layers = [m for m in engine.module.modules() if isinstance(m, MoE)]
    engine.has_moe_layers = bool(layers)
    engine.num_experts = [m.num_experts for m in layers]
    for layer in layers:
        layer.set_deepspeed_parallelism(engine.runtime.comm)
