"""Multi-tensor fused CUDA optimizers: FusedAdam, FusedLamb, FusedLion (ops fused_adam/lamb/lion).

One kernel launch updates many tensors (see ``csrc/includes/dscore_multi_tensor.cuh``). Parameters
and gradients are CUDA tensors of one dtype per group (fp32, fp16 or bf16; mixed dtypes are split into
one launch per dtype); optimizer states are fp32 tensors shaped like the parameter, under the same
state keys as ``torch.optim.Adam`` (``step``, ``exp_avg``, ``exp_avg_sq``) so checkpoints interchange.

The op is JIT-built (nvcc + ninja) on first construction. On a machine without CUDA the constructor
raises :class:`~dscore.errors.OpBuildError` with the reason.

Sources: Adam — Kingma & Ba 2015; AdamW — Loshchilov & Hutter 2019; LAMB — You et al. 2020;
Lion — Chen et al. 2023.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from dscore.errors import ConfigError, OpBuildError

if TYPE_CHECKING:
    from dscore.protocols import OptimizerContext
    from dscore_plugins.ops.config import FusedAdamParams, FusedLambParams, LionParams

__all__ = ["FusedAdam", "FusedLamb", "FusedLion", "build_fused_adam", "build_fused_lamb", "build_fused_lion"]


class _FusedOptimizer(torch.optim.Optimizer):
    _OP = ""
    _STATE_KEYS: tuple[str, ...] = ()

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any]) -> None:
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.device.type != "cuda" or p.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                    raise OpBuildError(
                        f"{type(self).__name__} needs fp32/fp16/bf16 CUDA parameters, got {p.dtype} on {p.device}; "
                        "use DscoreCPUAdam/DscoreCPULion for CPU parameters"
                    )
        from dscore.ops import get_op_builder

        self._op = get_op_builder(self._OP).load()

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)

    def _lists(self, group: dict[str, Any]) -> dict[tuple[torch.dtype, torch.device, int], list[list[torch.Tensor]]]:
        """Per (dtype, device, step): [params, grads, *states] of the params with a gradient; bumps ``step``."""
        buckets: dict[tuple[torch.dtype, torch.device, int], list[list[torch.Tensor]]] = {}
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise OpBuildError(f"{type(self).__name__} does not support sparse gradients")
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                for key in self._STATE_KEYS:
                    state[key] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            state["step"] += 1
            key = (p.dtype, p.device, int(state["step"].item()))
            lists = buckets.setdefault(key, [[] for _ in range(2 + len(self._STATE_KEYS))])
            lists[0].append(p)
            lists[1].append(p.grad.contiguous())
            for i, key in enumerate(self._STATE_KEYS):
                lists[2 + i].append(state[key])
        return buckets

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One step over every parameter with a gradient; returns ``closure()`` if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            buckets = self._lists(group)
            for (_, _, step), lists in buckets.items():
                if any(not p.is_contiguous() for p in lists[0]):
                    raise OpBuildError(f"{type(self).__name__} needs contiguous parameters")
                self._launch(group, lists, step)
        return loss

    def _launch(self, group: dict[str, Any], lists: list[list[torch.Tensor]], step: int) -> None:
        raise NotImplementedError


def _betas(betas: tuple[float, float]) -> tuple[float, float]:
    b1, b2 = (float(b) for b in betas)
    for key, b in (("betas[0]", b1), ("betas[1]", b2)):
        if not 0.0 <= b < 1.0:
            raise ConfigError(f"optimizer parameter {key}={b!r} must be in [0, 1)", path=f"optimizer.params.{key}")
    return b1, b2


class FusedAdam(_FusedOptimizer):
    """Adam / AdamW on CUDA with one multi-tensor launch per dtype (DeepSpeed's ``FusedAdam`` defaults).

    Args:
        params: CUDA tensors (fp32/fp16/bf16) or param-group dicts.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
        adam_w_mode: decoupled weight decay (True) or L2 added to the gradient (False).
        bias_correction: divide the moments by ``1 - beta^t``.
        amsgrad: not supported (raises :class:`~dscore.errors.ConfigError`).

    Raises:
        ConfigError: amsgrad or an out-of-range hyperparameter. OpBuildError: not CUDA, or build failure.
    """

    _OP = "fused_adam"
    _STATE_KEYS = ("exp_avg", "exp_avg_sq")

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ) -> None:
        if amsgrad:
            raise ConfigError("FusedAdam does not support amsgrad=True", path="optimizer.params.amsgrad")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=_betas(betas), eps=eps,
                        adam_w_mode=adam_w_mode, weight_decay=weight_decay)
        self.set_grad_none = set_grad_none
        super().__init__(params, defaults)

    def _launch(self, group, lists, step):  # type: ignore[no-untyped-def]
        b1, b2 = group["betas"]
        self._op.fused_adam(lists[0], lists[1], lists[2], lists[3], float(group["lr"]), b1, b2, float(group["eps"]),
                            float(group["weight_decay"]), step, bool(group["adam_w_mode"]),
                            bool(group["bias_correction"]))


class FusedLamb(_FusedOptimizer):
    """LAMB (You et al. 2020) on CUDA: Adam-style update scaled per tensor by ``||p|| / ||u||``.

    ``u = m_hat / (sqrt(v_hat) + eps) + weight_decay * p``; the trust ratio is 1 when either norm is 0
    and is clamped to ``[min_coeff, max_coeff]``; ``p -= lr * ratio * u``.

    Raises:
        ConfigError: out-of-range hyperparameters. OpBuildError: not CUDA, or build failure.
    """

    _OP = "fused_lamb"
    _STATE_KEYS = ("exp_avg", "exp_avg_sq")

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
    ) -> None:
        if not 0.0 <= min_coeff <= max_coeff:
            raise ConfigError(f"FusedLamb needs 0 <= min_coeff <= max_coeff, got {min_coeff}, {max_coeff}",
                              path="optimizer.params.min_coeff")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=_betas(betas), eps=eps,
                        weight_decay=weight_decay, max_coeff=max_coeff, min_coeff=min_coeff)
        super().__init__(params, defaults)

    def _launch(self, group, lists, step):  # type: ignore[no-untyped-def]
        b1, b2 = group["betas"]
        self._op.fused_lamb(lists[0], lists[1], lists[2], lists[3], float(group["lr"]), b1, b2, float(group["eps"]),
                            float(group["weight_decay"]), step, bool(group["bias_correction"]),
                            float(group["max_coeff"]), float(group["min_coeff"]))


class FusedLion(_FusedOptimizer):
    """Lion (Chen et al. 2023) on CUDA: ``p = p*(1-lr*wd) - lr*sign(b1*m + (1-b1)*g)``; ``m = b2*m + (1-b2)*g``.

    Raises:
        ConfigError: out-of-range hyperparameters. OpBuildError: not CUDA, or build failure.
    """

    _OP = "fused_lion"
    _STATE_KEYS = ("exp_avg",)

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, dict(lr=lr, betas=_betas(betas), weight_decay=weight_decay))

    def _launch(self, group, lists, step):  # type: ignore[no-untyped-def]
        b1, b2 = group["betas"]
        self._op.fused_lion(lists[0], lists[1], lists[2], float(group["lr"]), b1, b2, float(group["weight_decay"]))


# OptimizerSpec factories (``factory(param_groups, ctx)``): every value from the validated params model.
def build_fused_adam(param_groups: list[dict[str, Any]], ctx: OptimizerContext[FusedAdamParams]) -> FusedAdam:
    """``FusedAdam`` from the validated ``optimizer.params``."""
    p = ctx.section
    return FusedAdam(
        param_groups, lr=p.lr, bias_correction=p.bias_correction, betas=p.betas, eps=p.eps,
        adam_w_mode=p.adam_w_mode, weight_decay=p.weight_decay, amsgrad=p.amsgrad, set_grad_none=p.set_grad_none,
    )


def build_fused_lamb(param_groups: list[dict[str, Any]], ctx: OptimizerContext[FusedLambParams]) -> FusedLamb:
    """``FusedLamb`` from the validated ``optimizer.params``."""
    p = ctx.section
    return FusedLamb(
        param_groups, lr=p.lr, bias_correction=p.bias_correction, betas=p.betas, eps=p.eps,
        weight_decay=p.weight_decay, max_coeff=p.max_coeff, min_coeff=p.min_coeff,
    )


def build_fused_lion(param_groups: list[dict[str, Any]], ctx: OptimizerContext[LionParams]) -> FusedLion:
    """``FusedLion`` from the validated ``optimizer.params``."""
    p = ctx.section
    return FusedLion(param_groups, lr=p.lr, betas=p.betas, weight_decay=p.weight_decay)
