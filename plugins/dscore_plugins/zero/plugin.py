"""Manifest of the built-in ZeRO plugin (torch-free: specs only).

Stage 0 is plain data parallelism; stages 1-3 partition optimizer state, gradients and parameters.
Each stage's class implements :class:`dscore.protocols.ZeroStage`.
"""

from __future__ import annotations

from dscore import hookimpl
from dscore.specs import ConfigSectionSpec, ZeroStageSpec


@hookimpl
def dscore_register_zero_stages() -> list[ZeroStageSpec]:
    """The ZeRO stages selectable by ``zero_optimization.stage``."""
    return [
        ZeroStageSpec(
            name="stage0",
            stage=0,
            factory="dscore_plugins.zero.stage0:Stage0",
            description="plain data parallelism: flat-buffer gradient all-reduce, fp32 master weights for fp16/bf16",
        ),
        ZeroStageSpec(
            name="stage1",
            stage=1,
            factory="dscore_plugins.zero.stage1:Stage1",
            description="ZeRO-1: optimizer state and fp32 master weights partitioned across data-parallel ranks",
        ),
        ZeroStageSpec(
            name="stage2",
            stage=2,
            factory="dscore_plugins.zero.stage2:Stage2",
            description="ZeRO-2: optimizer state and gradients partitioned; bucketed reduce-scatter in backward",
        ),
        ZeroStageSpec(
            name="stage3",
            stage=3,
            factory="dscore_plugins.zero.stage3:Stage3",
            description="ZeRO-3: parameters partitioned too, gathered just in time by module hooks",
        ),
    ]


@hookimpl
def dscore_register_config_sections() -> list[ConfigSectionSpec]:
    """The ``zero_optimization`` section (model in :mod:`dscore_plugins.zero.config`)."""
    return [
        ConfigSectionSpec(
            name="zero_optimization",
            model="dscore_plugins.zero.config:ZeroConfig",
            description="ZeRO stage, buckets, offload (DeepSpeed 0.19.8 fields and stage3_* aliases)",
        )
    ]
