"""SignSGD with momentum (Bernstein et al. 2018, "signSGD: Compressed Optimisation for Non-Convex Problems")."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from dscore.protocols import OptimizerContext
    from dscore_example_plugin.config import SignSGDParams


class SignSGD(torch.optim.Optimizer):
    """``m = momentum * m + (1 - momentum) * g``; ``p -= lr * (sign(m) + weight_decay * p)``.

    Args:
        params: parameters or param groups (fp32/bf16/fp16 tensors of any shape).
        lr: step size (> 0).
        momentum: EMA factor in [0, 1).
        weight_decay: decoupled weight decay (>= 0).

    Raises:
        ValueError: a hyper-parameter is out of range.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, momentum: float = 0.9, weight_decay: float = 0.0):
        if lr <= 0 or not 0 <= momentum < 1 or weight_decay < 0:
            raise ValueError(f"SignSGD: invalid lr={lr}, momentum={momentum} or weight_decay={weight_decay}")
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                m = state["momentum_buffer"]
                m.mul_(group["momentum"]).add_(p.grad, alpha=1 - group["momentum"])
                if group["weight_decay"]:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(m), alpha=-group["lr"])
        return loss


def build_sign_sgd(param_groups: list[dict[str, Any]], ctx: OptimizerContext[SignSGDParams]) -> SignSGD:
    """The ``SignSGD`` factory dscore calls: ``ctx.section`` is ``optimizer.params`` already validated by
    :class:`~dscore_example_plugin.config.SignSGDParams` (which holds the defaults)."""
    p = ctx.section
    return SignSGD(param_groups, lr=p.lr, momentum=p.momentum, weight_decay=p.weight_decay)
