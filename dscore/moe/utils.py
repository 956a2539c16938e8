"""Parameter helpers for MoE models (DeepSpeed 0.19.8's ``deepspeed.moe.utils``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

__all__ = [
    "has_moe_layers",
    "is_moe_param",
    "is_moe_param_group",
    "split_params_grads_into_shared_and_expert_params",
    "split_params_into_different_moe_groups_for_optimizer",
    "split_params_into_shared_and_expert_params",
]


def has_moe_layers(module: nn.Module) -> tuple[bool, int]:
    """``(True, num_experts of the first MoE layer)`` when ``module`` holds a :class:`dscore.moe.layer.MoE`."""
    from dscore.moe.layer import MoE

    for m in module.modules():
        if isinstance(m, MoE):
            return True, m.num_experts
    return False, 0


def is_moe_param(param: torch.Tensor) -> bool:
    """True for expert parameters (tagged ``allreduce = False`` by :class:`dscore.moe.experts.Experts`)."""
    return getattr(param, "allreduce", True) is False


def is_moe_param_group(group: dict[str, Any]) -> bool:
    """True for an optimizer group made by :func:`split_params_into_different_moe_groups_for_optimizer`."""
    return bool(group.get("moe", False))


def split_params_into_shared_and_expert_params(
    params: Iterable[nn.Parameter],
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(shared, expert)`` parameters."""
    shared: list[nn.Parameter] = []
    expert: list[nn.Parameter] = []
    for p in params:
        (expert if is_moe_param(p) else shared).append(p)
    return shared, expert


def split_params_grads_into_shared_and_expert_params(
    group: Iterable[nn.Parameter],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(shared grads, expert grads)`` of the parameters that have a gradient (in the parameters' dtype)."""
    shared: list[torch.Tensor] = []
    expert: list[torch.Tensor] = []
    for p in group:
        if p.grad is not None:
            (expert if is_moe_param(p) else shared).append(p.grad.to(p.dtype))
    return shared, expert


def split_params_into_different_moe_groups_for_optimizer(
    param_groups: dict[str, Any] | tuple[dict[str, Any], ...] | list[dict[str, Any]],
    max_group_size: int | float | None = 178956971,
) -> list[dict[str, Any]]:
    """Move expert parameters into their own optimizer groups (DeepSpeed's layout).

    Every input group keeps its non-expert parameters; for each input group and each expert group name
    (``ep_size_<E>``), new groups ``{**group, "name": "ep_size_<E>", "moe": True, "params": [...]}`` are
    appended, split so none holds more than ``max_group_size`` elements (None: one group each). A group
    without ``"name"`` is named ``"group_<i>"`` (DeepSpeed requires the key).

    Returns:
        The (modified, for a list) list of groups.

    Raises:
        TypeError: ``param_groups`` is not a dict, tuple or list.
    """
    if isinstance(param_groups, tuple):
        groups = list(param_groups)
    elif isinstance(param_groups, dict):
        groups = [param_groups]
    elif isinstance(param_groups, list):
        groups = param_groups
    else:
        raise TypeError(f"param_groups must be a dict, tuple or list of dicts, got {type(param_groups).__name__}")
    for i, g in enumerate(groups):
        g.setdefault("name", f"group_{i}")
        g["params"] = list(g["params"])
    names = sorted({p.group_name for g in groups for p in g["params"] if is_moe_param(p)})
    appended: list[dict[str, Any]] = []
    for g in list(groups):
        by_name: dict[str, list[nn.Parameter]] = {n: [] for n in names}
        keep = []
        for p in g["params"]:
            if is_moe_param(p):
                by_name[p.group_name].append(p)
            else:
                keep.append(p)
        g["params"] = keep
        for name in names:
            params = by_name[name]
            chunks: list[list[nn.Parameter]] = []
            if max_group_size is None:
                chunks = [params]
            else:
                cur: list[nn.Parameter] = []
                size = 0
                for p in params:
                    if cur and size + p.numel() > max_group_size:
                        chunks.append(cur)
                        cur, size = [], 0
                    cur.append(p)
                    size += p.numel()
                if cur:
                    chunks.append(cur)
            for chunk in chunks:
                appended.append({**g, "name": name, "moe": True, "params": chunk})
    groups.extend(appended)
    return groups
