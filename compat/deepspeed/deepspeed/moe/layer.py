"""``deepspeed.moe.layer.MoE``: :class:`dscore.moe.layer.MoE` (same arguments and returns)."""

from __future__ import annotations

from dscore.moe.layer import MoE

__all__ = ["MoE"]
