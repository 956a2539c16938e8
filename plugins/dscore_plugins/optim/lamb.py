"""LAMB (You et al., "Large Batch Optimization for Deep Learning", arXiv:1904.00962), as DeepSpeed's FusedLamb.

Per parameter ``p`` with gradient ``g`` (any shape/float dtype; state in the parameter's dtype),
at step ``t``::

    m = b1 m + (1 - b1) g ;  v = b2 v + (1 - b2) g^2
    m_hat = m / (1 - b1^t), v_hat = v / (1 - b2^t)     (when bias_correction, else m, v)
    u = m_hat / (sqrt(v_hat) + eps)                    (sqrt(v_hat + eps) when eps_inside_sqrt)
    u = u + weight_decay * p
    ratio = ||p|| / ||u||  if both norms > 0 else 1, clamped to [min_coeff, max_coeff]
    p = p - lr * ratio * u

The last trust ratios are available from :meth:`Lamb.get_lamb_coeffs` (as FusedLamb).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from dscore.errors import ConfigError

if TYPE_CHECKING:
    from dscore.protocols import OptimizerContext
    from dscore_plugins.optim.config import LambParams

__all__ = ["Lamb", "build_lamb"]


class Lamb(torch.optim.Optimizer):
    """LAMB optimizer (see the module docstring for the update).

    Args:
        params: tensors or param groups.
        lr: learning rate. betas: moment coefficients. eps: denominator term.
        bias_correction, eps_inside_sqrt, weight_decay, max_coeff, min_coeff: see the module docstring.

    Raises:
        ValueError: ``amsgrad`` requested (not supported, as FusedLamb).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
    ) -> None:
        if amsgrad:
            raise ValueError("Lamb does not support amsgrad")
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=tuple(betas),
            eps=eps,
            eps_inside_sqrt=eps_inside_sqrt,
            weight_decay=weight_decay,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
        )
        super().__init__(params, defaults)
        self.lamb_coeffs: list[float] = []

    def get_lamb_coeffs(self) -> list[float]:
        """Trust ratios applied at the last step, one per parameter with a gradient."""
        return list(self.lamb_coeffs)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.lamb_coeffs = []
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = state["step"]
                g = p.grad
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                c1 = 1 - b1**t if group["bias_correction"] else 1.0
                c2 = 1 - b2**t if group["bias_correction"] else 1.0
                v_hat = v / c2
                denom = (v_hat + group["eps"]).sqrt() if group["eps_inside_sqrt"] else v_hat.sqrt().add_(group["eps"])
                update = (m / c1).div_(denom)
                if group["weight_decay"] != 0:
                    update.add_(p, alpha=group["weight_decay"])
                w_norm = float(p.float().norm())
                u_norm = float(update.float().norm())
                ratio = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
                ratio = min(max(ratio, group["min_coeff"]), group["max_coeff"])
                self.lamb_coeffs.append(ratio)
                p.add_(update, alpha=-group["lr"] * ratio)
        return loss


def build_lamb(param_groups: list[dict[str, Any]], ctx: OptimizerContext[LambParams]) -> Lamb:
    """OptimizerSpec factory for ``lamb`` (``ctx.section``: the validated ``optimizer.params``).

    Raises:
        ConfigError: fp16 with a static ``fp16.loss_scale`` (DeepSpeed: "lamb optimizer requires dynamic
            loss scaling"; LAMB's trust ratio would see gradients scaled by a constant it cannot undo).
    """
    fp16 = ctx.config.section("fp16", None)
    if fp16 is not None and getattr(fp16, "enabled", False) and float(getattr(fp16, "loss_scale", 0.0)) != 0.0:
        raise ConfigError(
            f"optimizer.type Lamb requires dynamic loss scaling, but fp16.loss_scale is {fp16.loss_scale} "
            "(static); set fp16.loss_scale to 0 (dynamic) as DeepSpeed requires",
            path="fp16.loss_scale",
        )
    p = ctx.section
    return Lamb(
        param_groups, lr=p.lr, bias_correction=p.bias_correction, betas=p.betas, eps=p.eps,
        eps_inside_sqrt=p.eps_inside_sqrt, weight_decay=p.weight_decay, max_coeff=p.max_coeff,
        min_coeff=p.min_coeff, amsgrad=p.amsgrad,
    )
