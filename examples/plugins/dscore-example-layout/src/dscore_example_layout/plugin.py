"""Manifest: registers the ``sharded`` checkpoint layout (torch-free)."""

from __future__ import annotations

from dscore import hookimpl
from dscore.specs import CheckpointLayoutSpec

__all__ = ["dscore_register_checkpoint_layouts"]


@hookimpl
def dscore_register_checkpoint_layouts() -> list[CheckpointLayoutSpec]:
    """The ``sharded`` layout, detected before the built-in ones (it has a marker file of its own)."""
    return [
        CheckpointLayoutSpec(
            name="sharded",
            layout="dscore_example_layout.layout:SHARDED_LAYOUT",
            detect_priority=200,
            description="example: one safetensors shard per rank plus sharded_manifest.json",
        )
    ]
