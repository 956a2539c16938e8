"""``deepspeed.checkpoint.utils.clone_tensors_for_torch_save``."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["clone_tensors_for_torch_save"]


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = "cpu") -> Any:
    """Copy every tensor of a (nested list/tuple/dict) value to ``device`` as a compact tensor of its own,
    so ``torch.save`` writes only its elements (a view of a large flat buffer would save the whole buffer).
    Other values are returned as they are."""
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)((k, clone_tensors_for_torch_save(v, device)) for k, v in item.items())
    return item
