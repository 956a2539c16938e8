"""Muon with an auxiliary Adam, as DeepSpeed's ``MuonWithAuxAdam`` selects parameters.

Muon (K. Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks",
https://kellerjordan.github.io/posts/muon/) updates a matrix parameter ``W`` (rows x cols; conv kernels are
flattened to ``(out, -1)``) with an orthogonalised momentum::

    buf = mu buf + (1 - mu) g                     (Nesterov: u = (1 - mu) g + mu buf, else u = buf)
    O   = NewtonSchulz5(u)                        (quintic iteration, coefficients 3.4445, -4.7750, 2.0315,
                                                   computed in bf16 on u / ||u||_F)
    W   = W (1 - lr wd) - lr * max(1, rows/cols)^0.5 * O

Every other parameter (vectors, and matrices flagged ``use_muon = False``) uses Adam with bias correction
and decoupled weight decay (AdamW) at ``adam_lr``.

Which parameters use Muon: a tensor's ``use_muon`` attribute when set, otherwise ``ndim >= 2``. The
factory sees tensors, not names, so DeepSpeed's rule "names containing ``embed`` or ``lm_head`` use Adam"
is applied by :func:`set_muon_flags` (call it on the model before ``dscore.initialize``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from dscore.protocols import OptimizerContext
    from dscore_plugins.optim.config import MuonParams

__all__ = ["MuonWithAuxAdam", "build_muon", "newton_schulz5", "set_muon_flags"]

log = logging.getLogger("dscore.optim")


_NS_COEFFS = (3.4445, -4.7750, 2.0315)


def newton_schulz5(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Approximately orthogonalise a 2-D ``g`` (rows x cols) with the quintic Newton-Schulz iteration.

    Returns a tensor of ``g``'s shape and dtype whose singular values lie roughly in [0.7, 1.2].
    """
    a, b, c = _NS_COEFFS
    x = g.to(torch.bfloat16)
    transposed = x.size(0) > x.size(1)
    if transposed:
        x = x.T
    x = x / (x.norm() + eps)
    for _ in range(steps):
        gram = x @ x.T
        poly = b * gram + c * (gram @ gram)
        x = a * x + poly @ x
    if transposed:
        x = x.T
    return x.to(g.dtype)


def set_muon_flags(module: torch.nn.Module) -> None:
    """Set ``p.use_muon`` on every parameter with DeepSpeed's rule: ``ndim >= 2`` and the parameter name
    contains neither ``"embed"`` nor ``"lm_head"``."""
    for name, p in module.named_parameters():
        p.use_muon = p.ndim >= 2 and "embed" not in name and "lm_head" not in name  # type: ignore[attr-defined]


def _uses_muon(p: torch.Tensor) -> bool:
    flag = getattr(p, "use_muon", None)
    return bool(flag) if flag is not None else p.ndim >= 2


class MuonWithAuxAdam(torch.optim.Optimizer):
    """Muon for matrices, AdamW for the rest (see the module docstring).

    Param groups carry ``use_muon`` (bool). Muon groups use ``lr``, ``momentum``, ``nesterov``,
    ``ns_steps``, ``weight_decay``; Adam groups use ``lr``, ``betas``, ``eps``, ``weight_decay``.
    ``defaults`` include ``betas`` so OneCycle's momentum cycling applies to the Adam part.
    """

    def __init__(self, param_groups: list[dict[str, Any]], defaults: dict[str, Any]) -> None:
        super().__init__(param_groups, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                g = p.grad
                if group["use_muon"]:
                    if not state:
                        state["momentum_buffer"] = torch.zeros_like(p)
                    buf = state["momentum_buffer"]
                    mu = group["momentum"]
                    buf.mul_(mu).add_(g, alpha=1 - mu)
                    u = g.mul(1 - mu).add_(buf, alpha=mu) if group["nesterov"] else buf.clone()
                    shape = u.shape
                    mat = u.reshape(shape[0], -1) if u.ndim != 2 else u
                    ortho = newton_schulz5(mat, steps=group["ns_steps"])
                    scale = max(1.0, mat.size(0) / mat.size(1)) ** 0.5
                    if wd != 0:
                        p.mul_(1 - lr * wd)
                    p.add_(ortho.reshape(shape), alpha=-lr * scale)
                else:
                    if not state:
                        state["step"] = 0
                        state["exp_avg"] = torch.zeros_like(p)
                        state["exp_avg_sq"] = torch.zeros_like(p)
                    state["step"] += 1
                    b1, b2 = group["betas"]
                    m, v = state["exp_avg"], state["exp_avg_sq"]
                    m.mul_(b1).add_(g, alpha=1 - b1)
                    v.mul_(b2).addcmul_(g, g, value=1 - b2)
                    c1 = 1 - b1 ** state["step"]
                    c2 = 1 - b2 ** state["step"]
                    denom = (v / c2).sqrt_().add_(group["eps"])
                    if wd != 0:
                        p.mul_(1 - lr * wd)
                    p.addcdiv_(m, denom, value=-lr / c1)
        return loss


def build_muon(param_groups: list[dict[str, Any]], ctx: OptimizerContext[MuonParams]) -> MuonWithAuxAdam:
    """OptimizerSpec factory for ``muon``: split every incoming group into a Muon and an Adam group.

    Group-level overrides of the incoming groups (e.g. ``weight_decay``) are kept in both halves.

    Learning rates as DeepSpeed 0.19.8 (``lr`` is given to both halves; ``muon_lr`` / ``adam_lr`` override
    it): without any of them the Muon half uses 0.02 and the Adam half 3e-4 (MuonWithAuxAdam's own
    per-half defaults, :meth:`MuonParams.resolved_lrs`), not 0.02 for both.

    Raises:
        dscore.errors.ConfigError: ``ns_method`` other than ``"newton_schulz"`` or ``per_head_muon`` true
            (the params model refuses both at config load already).
    """
    from dscore.errors import ConfigError

    hp = ctx.section
    if hp.ns_method != "newton_schulz":
        raise ConfigError(
            f"{ctx.key('ns_method')}={hp.ns_method!r} is not implemented; valid: 'newton_schulz'",
            path=ctx.key("ns_method"),
        )
    if hp.per_head_muon:
        raise ConfigError(f"{ctx.key('per_head_muon')} is not implemented in dscore", path=ctx.key("per_head_muon"))
    muon_lr, adam_lr = hp.resolved_lrs()
    momentum, nesterov, ns_steps, betas, eps, weight_decay = (
        hp.momentum, hp.nesterov, hp.ns_steps, hp.betas, hp.eps, hp.weight_decay
    )
    groups = [dict(g) for g in param_groups]
    out: list[dict[str, Any]] = []
    for group in groups:
        tensors = list(group.pop("params"))
        muon = [p for p in tensors if _uses_muon(p)]
        aux = [p for p in tensors if not _uses_muon(p)]
        group.pop("lr", None)
        if muon:
            out.append({**group, "params": muon, "use_muon": True, "lr": muon_lr})
        if aux:
            out.append({**group, "params": aux, "use_muon": False, "lr": adam_lr})
    defaults = dict(
        lr=muon_lr,
        momentum=momentum,
        nesterov=nesterov,
        ns_steps=ns_steps,
        betas=tuple(betas),
        eps=eps,
        weight_decay=weight_decay,
        use_muon=False,
    )
    log.debug(
        "Muon: %d Muon group(s), %d Adam group(s)", sum(g["use_muon"] for g in out), sum(not g["use_muon"] for g in out)
    )
    return MuonWithAuxAdam(out, defaults)
