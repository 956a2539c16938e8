"""Cheap inf/NaN detection over many gradient tensors.

Used by the ZeRO stages (plugin-to-plugin: ``from dscore_plugins.precision.overflow import has_overflow``).
One fused ``torch._foreach_norm(ord=inf)`` per (device, dtype) group gives each tensor's max-abs value,
which is non-finite iff the tensor holds an inf or NaN (max propagates NaN). Unlike a sum or an L2 norm,
a max-abs of finite values can never overflow, so there are no false positives for large finite fp16
gradients. The result stays on the device until the caller syncs (one ``.item()``), so a caller can
all-reduce :func:`overflow_flag` with MAX across ranks first.

Mirrors the purpose of DeepSpeed's ``CheckOverflow`` (``deepspeed/runtime/utils.py``), which all-reduces
a per-rank flag with MAX.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["has_overflow", "overflow_flag"]


def overflow_flag(tensors: Iterable[torch.Tensor | None], device: torch.device | str | None = None) -> torch.Tensor:
    """A 0-dim float32 tensor: 1.0 when any tensor holds an inf or NaN, else 0.0.

    Args:
        tensors: gradients or any floating-point tensors (any shapes, dtypes, devices); ``None`` and empty
            tensors are skipped.
        device: where the flag lives (default: the first tensor's device, or CPU when there is none).

    Returns:
        ``torch.float32`` scalar on ``device`` (no host sync happened).
    """
    import torch

    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        groups.setdefault((t.device, t.dtype), []).append(t)
    if device is None:
        device = next(iter(groups))[0] if groups else torch.device("cpu")
    flag = torch.zeros((), dtype=torch.float32, device=device)
    for group in groups.values():
        if group[0].is_sparse:
            finite = torch.stack([torch.isfinite(g.coalesce().values()).all() for g in group]).all()
        else:
            norms = torch._foreach_norm(group, float("inf"))
            finite = torch.isfinite(torch.stack([n.float() for n in norms])).all()
        flag = torch.maximum(flag, (~finite).float().to(device))
    return flag


def has_overflow(tensors: Iterable[torch.Tensor | None]) -> bool:
    """True when any of ``tensors`` (this rank only) holds an inf or NaN; one host sync.

    See :func:`overflow_flag` to combine the flag across ranks before syncing.
    """
    return bool(overflow_flag(tensors).item() > 0)
