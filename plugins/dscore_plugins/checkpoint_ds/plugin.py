"""Manifest of the built-in checkpoint layouts (``dscore`` and ``deepspeed``); see the package docs."""

from __future__ import annotations

from dscore import hookimpl
from dscore.specs import CheckpointLayoutSpec

__all__ = ["dscore_register_checkpoint_layouts"]


@hookimpl
def dscore_register_checkpoint_layouts() -> list[CheckpointLayoutSpec]:
    """Register ``dscore`` (native; the default and the load fallback) and ``deepspeed``."""
    return [
        CheckpointLayoutSpec(
            name="dscore",
            layout="dscore.persistence.native:NATIVE_LAYOUT",
            detect_priority=0,
            description="dscore's native layout: safetensors + JSON, no pickle, world-size independent (default)",
        ),
        CheckpointLayoutSpec(
            name="deepspeed",
            layout="dscore_plugins.checkpoint_ds.layout:DEEPSPEED_LAYOUT",
            detect_priority=100,
            exports="dscore_plugins.checkpoint_ds.api",
            description="DeepSpeed 0.19.8's mp_rank_*/zero_pp_rank_* files: read safely at any world size and "
            "stage, written for tools that read them (ZeRO 1-3, fp32/bf16)",
        ),
    ]
