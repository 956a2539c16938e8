"""Manifest of the built-in engine plugin (torch-free: specs only).

``standard`` builds :class:`dscore.runtime.engine.DscoreEngine` for any ``torch.nn.Module``;
``pipeline`` builds :class:`dscore_plugins.engine.pipeline.PipelineEngine` for a
:class:`dscore.pipe.PipelineModule` (higher priority, so it wins for those); ``hybrid`` builds
:class:`dscore_plugins.engine.hybrid.HybridEngine` (training plus ``generate``) when the ``hybrid_engine`` block
is enabled (between the two: a pipeline model with the block enabled is refused by the pipeline engine); its ``exports``
(:mod:`dscore_plugins.engine.pipe.checkpoint`) provide the thin names ``dscore.pipe.layer_state_dicts`` and
``dscore.pipe.load_into_layers``.
"""

from __future__ import annotations

from typing import Any

from dscore import hookimpl
from dscore.specs import ConfigSectionSpec, EngineSpec


@hookimpl
def dscore_register_engines() -> list[EngineSpec]:
    """The standard engine, the pipeline engine (exporting the pipeline checkpoint readers) and the hybrid engine."""
    return [
        EngineSpec(
            name="standard",
            predicate="dscore_plugins.engine.standard:handles",
            factory="dscore.runtime.assembly:build_standard_engine",
            priority=0,
            description="data parallelism with ZeRO stages 0-3 for any torch.nn.Module",
        ),
        EngineSpec(
            name="pipeline",
            predicate="dscore_plugins.engine.pipeline:handles",
            factory="dscore_plugins.engine.pipeline:build_pipeline_engine",
            priority=100,
            description="pipeline parallelism (1F1B) x data parallelism for a dscore.pipe.PipelineModule",
            exports="dscore_plugins.engine.pipe.checkpoint",
        ),
        EngineSpec(
            name="hybrid",
            predicate="dscore_plugins.engine.hybrid:handles",
            factory="dscore_plugins.engine.hybrid:build_hybrid_engine",
            priority=50,
            description="the standard engine plus generate() for RLHF (DeepSpeed's Hybrid Engine), hybrid_engine.enabled",
        ),
    ]


@hookimpl
def dscore_register_config_sections() -> list[ConfigSectionSpec]:
    """The ``pipeline`` and ``hybrid_engine`` sections (models in :mod:`dscore_plugins.engine.config`)."""
    return [
        ConfigSectionSpec(
            name="pipeline",
            model="dscore_plugins.engine.config:PipelineConfig",
            description="pipeline-parallel settings checked against the PipelineModule (DeepSpeed 0.19.8 keys)",
        ),
        ConfigSectionSpec(
            name="hybrid_engine",
            model="dscore_plugins.engine.config:HybridEngineConfig",
            description="the hybrid (RLHF) engine: generate() inside the training engine (DeepSpeed 0.19.8 keys)",
        ),
    ]


@hookimpl
def dscore_engine_created(engine: Any) -> None:
    """Give the model's MoE layers their expert-parallel groups (:mod:`dscore_plugins.engine.moe`)."""
    module = getattr(engine, "module", None)
    if module is None:
        return
    from dscore_plugins.engine.moe import wire_moe_layers

    wire_moe_layers(engine)
