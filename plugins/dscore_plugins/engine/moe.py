"""MoE wiring of the engines: at engine creation every :class:`dscore.moe.layer.MoE` of the model gets
its expert-parallel group (DeepSpeed's engine calls ``set_deepspeed_parallelism`` the same way);
``engine.has_moe_layers`` / ``engine.num_experts`` are set as DeepSpeed's engine sets them. Called by the
engine plugin's ``dscore_engine_created`` hook (:mod:`dscore_plugins.engine.plugin`)."""

from __future__ import annotations

from typing import Any

__all__ = ["wire_moe_layers"]


def wire_moe_layers(engine: Any) -> None:
    """Give each MoE layer its expert groups: groups of the engine's mesh (collective)."""
    from dscore.moe.layer import MoE

    layers = [m for m in engine.module.modules() if isinstance(m, MoE)]
    engine.has_moe_layers = bool(layers)
    engine.num_experts = [m.num_experts for m in layers]
    for layer in layers:
        layer.set_deepspeed_parallelism(engine.runtime.comm, mesh=getattr(engine.runtime, "mesh", None))
