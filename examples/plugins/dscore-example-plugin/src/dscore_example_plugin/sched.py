"""Inverse-square-root LR schedule with linear warm-up (Vaswani et al. 2017, "Attention Is All You Need")."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from dscore.protocols import SchedulerContext
    from dscore_example_plugin.config import InverseSqrtLRParams


class InverseSqrtLR(torch.optim.lr_scheduler.LambdaLR):
    """lr(step) = base_lr * min(step / warmup, sqrt(warmup / step)) for step >= 1; 0 at step 0.

    Args:
        optimizer: the optimizer whose groups' ``lr`` is driven.
        warmup_num_steps: warm-up length in optimizer steps (> 0).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_num_steps: int = 1000) -> None:
        if warmup_num_steps <= 0:
            raise ValueError(f"InverseSqrtLR: warmup_num_steps must be > 0, got {warmup_num_steps}")
        self.warmup_num_steps = warmup_num_steps

        def factor(step: int) -> float:
            if step == 0:
                return 0.0
            return min(step / warmup_num_steps, math.sqrt(warmup_num_steps / step))

        super().__init__(optimizer, factor)


def build_inverse_sqrt_lr(
    optimizer: torch.optim.Optimizer, ctx: SchedulerContext[InverseSqrtLRParams]
) -> InverseSqrtLR:
    """The ``InverseSqrtLR`` factory dscore calls with the validated ``scheduler.params``."""
    return InverseSqrtLR(optimizer, warmup_num_steps=ctx.section.warmup_num_steps)
