"""Lion (Chen et al., "Symbolic Discovery of Optimization Algorithms", arXiv:2302.06675), as DeepSpeed's FusedLion.

Per parameter, with decoupled weight decay::

    c = b1 m + (1 - b1) g
    p = p (1 - lr * weight_decay) - lr * sign(c)
    m = b2 m + (1 - b2) g
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from dscore.protocols import OptimizerContext
    from dscore_plugins.optim.config import LionParams

__all__ = ["Lion", "build_lion"]


class Lion(torch.optim.Optimizer):
    """Lion optimizer (update in the module docstring); state ``exp_avg`` has the parameter's shape/dtype.

    Args:
        params: tensors or param groups. lr: learning rate (typically 3-10x smaller than AdamW's).
        betas: (interpolation, momentum) coefficients. weight_decay: decoupled weight decay.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                m = state["exp_avg"]
                c = m.mul(b1).add_(p.grad, alpha=1 - b1)
                if wd != 0:
                    p.mul_(1 - lr * wd)
                p.add_(c.sign_(), alpha=-lr)
                m.mul_(b2).add_(p.grad, alpha=1 - b2)
        return loss


def build_lion(param_groups: list[dict[str, Any]], ctx: OptimizerContext[LionParams]) -> Lion:
    """OptimizerSpec factory for ``lion`` (``ctx.section``: the validated ``optimizer.params``)."""
    p = ctx.section
    return Lion(param_groups, lr=p.lr, betas=p.betas, weight_decay=p.weight_decay)
