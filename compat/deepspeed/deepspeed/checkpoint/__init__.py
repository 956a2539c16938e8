"""``deepspeed.checkpoint``: ``utils.clone_tensors_for_torch_save``."""

from __future__ import annotations

__all__ = ["utils"]
