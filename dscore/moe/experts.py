"""The experts of one MoE layer held by this rank (DeepSpeed's ``deepspeed.moe.experts.Experts``)."""

from __future__ import annotations

import copy

import torch
from torch import nn

__all__ = ["Experts"]


class Experts(nn.Module):
    """``num_local_experts`` deep copies of ``expert``; their parameters are tagged as expert parameters
    (``allreduce = False``, ``group_name = "ep_size_<E>"``), as DeepSpeed tags them.

    Args:
        expert: the expert module (any module mapping ``[..., d_model]`` to ``[..., d_model]``; a tuple
            output's first element is used).
        num_local_experts: experts on this rank.
        expert_group_name: ``ep_size_<E>``.
    """

    def __init__(self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: str | None = None) -> None:
        super().__init__()
        self.deepspeed_experts = nn.ModuleList([copy.deepcopy(expert) for _ in range(num_local_experts)])
        self.num_local_experts = num_local_experts
        for e in self.deepspeed_experts:
            for p in e.parameters():
                p.allreduce = False  # type: ignore[attr-defined]
                p.group_name = expert_group_name  # type: ignore[attr-defined]

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """``inputs``: ``[ep_size, num_local_experts, capacity, d_model]``; expert ``l`` gets slice ``l`` of
        dim 1. Returns the same shape."""
        outputs = []
        for chunk, expert in zip(inputs.chunk(self.num_local_experts, dim=1), self.deepspeed_experts):
            out = expert(chunk)
            outputs.append(out[0] if isinstance(out, tuple) else out)
        return torch.cat(outputs, dim=1)
