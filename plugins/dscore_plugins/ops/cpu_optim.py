"""CPU optimizers running the cpu_adam / cpu_adagrad / cpu_lion ops (used by ZeRO optimizer offload).

Each class is a real :class:`torch.optim.Optimizer` whose state has the same keys as the torch
optimizer it mirrors (``step``, ``exp_avg``, ``exp_avg_sq`` for Adam; ``step``, ``sum`` for Adagrad;
``exp_avg`` for Lion), so ``state_dict()``/``load_state_dict()`` checkpoints interchange with
``torch.optim.Adam``/``AdamW``/``Adagrad``.

Parameters must be contiguous fp32 CPU tensors (the fp32 master copy ZeRO offload keeps); gradients
fp32 of the same shape. :meth:`step_with_copy` also writes the updated parameters as fp16/bf16 into
caller-provided CPU tensors in the same memory pass (the low-precision copy ZeRO sends back to the
device), saving a separate read of the fp32 parameters.

The op is JIT-built (ninja) on first construction and cached (see :mod:`dscore.ops`). Threads: the
kernels use ``torch.get_num_threads()`` OpenMP threads.

Sources: Adam — Kingma & Ba 2015; AdamW — Loshchilov & Hutter 2019; Adagrad — Duchi et al. 2011;
Lion — Chen et al. 2023.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from dscore.errors import ConfigError, OpBuildError

if TYPE_CHECKING:
    from dscore.protocols import OptimizerContext
    from dscore_plugins.ops.config import AdagradParams, CPUAdamParams, LionParams

__all__ = [
    "DscoreCPUAdagrad",
    "DscoreCPUAdam",
    "DscoreCPULion",
    "build_cpu_adagrad",
    "build_cpu_adam",
    "build_cpu_lion",
]

_COPY_CODES = {torch.float16: 1, torch.bfloat16: 2}


def _load(name: str) -> Any:
    from dscore.ops import get_op_builder

    try:
        return get_op_builder(name).load()
    except OpBuildError:
        raise
    except Exception as exc:  # registry errors are DscoreErrors already; anything else is wrapped
        raise OpBuildError(f"cannot load op {name!r}: {exc}") from exc


def _check_param(p: torch.Tensor, what: str) -> None:
    if p.device.type != "cpu" or p.dtype != torch.float32 or not p.is_contiguous():
        raise OpBuildError(
            f"{what}: parameters must be contiguous fp32 CPU tensors (got {p.dtype} on {p.device}, "
            f"contiguous={p.is_contiguous()}); keep an fp32 CPU master copy (ZeRO offload does)"
        )


def _check_grad(p: torch.Tensor, g: torch.Tensor, what: str) -> None:
    if g.is_sparse:
        raise OpBuildError(f"{what} does not support sparse gradients")
    if g.device.type != "cpu" or g.dtype != torch.float32 or not g.is_contiguous() or g.numel() != p.numel():
        raise OpBuildError(
            f"{what}: gradients must be contiguous fp32 CPU tensors with the parameter's {p.numel()} elements "
            f"(got {g.dtype} on {g.device}, {g.numel()} elements)"
        )


def _copy_target(copy: torch.Tensor | None, p: torch.Tensor, what: str) -> tuple[int, int]:
    """(address, dtype code) of a low-precision copy target, (0, 0) for none."""
    if copy is None:
        return 0, 0
    code = _COPY_CODES.get(copy.dtype)
    if code is None or copy.device.type != "cpu" or not copy.is_contiguous() or copy.numel() != p.numel():
        raise OpBuildError(
            f"{what}: copy targets must be contiguous fp16/bf16 CPU tensors with {p.numel()} elements "
            f"(got {copy.dtype} on {copy.device}, {copy.numel()} elements)"
        )
    return copy.data_ptr(), code


class _CPUOptimizer(torch.optim.Optimizer):
    """Shared step loop: validation, lazy state, optional low-precision copy targets."""

    _OP = ""

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any]) -> None:
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                _check_param(p, type(self).__name__)
        self._op = _load(self._OP)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A state_dict saved by the torch optimizer lacks our extra group keys: fill the defaults.
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One optimizer step over every parameter with a gradient; returns ``closure()`` if given."""
        return self._step(closure, None)

    @torch.no_grad()
    def step_with_copy(
        self, copies: Sequence[torch.Tensor | None], closure: Callable[[], float] | None = None
    ) -> float | None:
        """Step and write each updated parameter, rounded to nearest even, into ``copies``.

        Args:
            copies: one entry per parameter in ``param_groups`` order (all groups flattened): a contiguous
                fp16 or bf16 CPU tensor with the parameter's number of elements (pinned memory is fine), or
                ``None`` to skip that parameter's copy.

        Raises:
            OpBuildError: ``copies`` has the wrong length, or an entry has the wrong dtype/device/size.
        """
        flat = [p for g in self.param_groups for p in g["params"]]
        if len(copies) != len(flat):
            raise OpBuildError(f"step_with_copy: got {len(copies)} copy targets for {len(flat)} parameters")
        return self._step(closure, {id(p): c for p, c in zip(flat, copies)})

    def _step(self, closure: Callable[[], float] | None, copies: dict[int, torch.Tensor | None] | None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        threads = torch.get_num_threads()
        name = type(self).__name__
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                _check_param(p, name)
                _check_grad(p, p.grad, name)
                addr, code = _copy_target(copies.get(id(p)) if copies else None, p, name)
                self._update(p, p.grad, group, self.state[p], addr, code, threads)
        return loss

    def _update(
        self, p: torch.Tensor, g: torch.Tensor, group: dict[str, Any], state: dict[str, Any], copy: int, code: int,
        threads: int,
    ) -> None:
        raise NotImplementedError


def _next_step(state: dict[str, Any]) -> int:
    step = state.get("step")
    value = int(step.item()) + 1 if isinstance(step, torch.Tensor) else int(step or 0) + 1
    state["step"] = torch.scalar_tensor(float(value), dtype=torch.float32)  # a few us cheaper than torch.tensor
    return value


class DscoreCPUAdam(_CPUOptimizer):
    """Adam / AdamW on fp32 CPU parameters through the ``cpu_adam`` op (AVX2/AVX-512, OpenMP).

    Args:
        params: iterable of contiguous fp32 CPU tensors or param-group dicts.
        lr: learning rate.
        betas: ``(beta1, beta2)`` running-average coefficients.
        eps: added to the bias-corrected ``sqrt(exp_avg_sq)``.
        weight_decay: decoupled (``adamw_mode=True``, like ``torch.optim.AdamW``) or L2 added to the
            gradient (``adamw_mode=False``, like ``torch.optim.Adam``).
        amsgrad: not supported (raises), as in DeepSpeed's CPU Adam.
        adamw_mode: decoupled weight decay (default True, DeepSpeed's default even for ``"type": "Adam"``).
        bias_correction: divide the moments by ``1 - beta^t`` (default True).

    State per parameter: ``step`` (0-d fp32 tensor), ``exp_avg``, ``exp_avg_sq`` (fp32, param's shape).

    Raises:
        ConfigError: ``amsgrad=True`` or a hyperparameter out of range.
        OpBuildError: a parameter is not a contiguous fp32 CPU tensor, or the op cannot be built.
    """

    _OP = "cpu_adam"

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        bias_correction: bool = True,
    ) -> None:
        if amsgrad:
            raise ConfigError("DscoreCPUAdam does not support amsgrad=True", path="optimizer.params.amsgrad")
        _check_range(lr=lr, eps=eps, weight_decay=weight_decay, beta1=betas[0], beta2=betas[1])
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=False,
                        adamw_mode=adamw_mode, bias_correction=bias_correction)
        super().__init__(params, defaults)

    def _update(self, p, g, group, state, copy, code, threads):  # type: ignore[no-untyped-def]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        m, v = state["exp_avg"], state["exp_avg_sq"]
        for t in (m, v):
            _check_param(t, "DscoreCPUAdam state")
        step = _next_step(state)
        lr, wd = float(group["lr"]), float(group["weight_decay"])
        beta1, beta2 = (float(b) for b in group["betas"])
        if group["bias_correction"]:
            neg_step = -lr / (1.0 - beta1**step)
            inv_bc2_sqrt = 1.0 / math.sqrt(1.0 - beta2**step)
        else:
            neg_step, inv_bc2_sqrt = -lr, 1.0
        decay = 1.0 - lr * wd if group["adamw_mode"] else 1.0
        l2 = 0.0 if group["adamw_mode"] else wd
        self._op.adam_update(
            p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), p.numel(), 1.0 - beta1, beta2, 1.0 - beta2,
            neg_step, inv_bc2_sqrt, float(group["eps"]), decay, l2, copy, code, threads,
        )


class DscoreCPUAdagrad(_CPUOptimizer):
    """Adagrad on fp32 CPU parameters through the ``cpu_adagrad`` op.

    Args:
        params: iterable of contiguous fp32 CPU tensors or param-group dicts.
        lr: learning rate (DeepSpeed's default 1e-2).
        lr_decay: ``lr / (1 + (t - 1) * lr_decay)`` at step ``t``, as ``torch.optim.Adagrad``.
        weight_decay: L2 penalty added to the gradient.
        initial_accumulator_value: starting value of the squared-gradient sum.
        eps: added to ``sqrt(sum)`` (DeepSpeed's default 1e-10).

    State per parameter: ``step`` (0-d fp32 tensor), ``sum`` (fp32, param's shape).

    Raises:
        ConfigError: a hyperparameter out of range.
        OpBuildError: a parameter is not a contiguous fp32 CPU tensor, or the op cannot be built.
    """

    _OP = "cpu_adagrad"

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
    ) -> None:
        _check_range(lr=lr, eps=eps, weight_decay=weight_decay, lr_decay=lr_decay,
                     initial_accumulator_value=initial_accumulator_value)
        defaults = dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                        initial_accumulator_value=initial_accumulator_value, eps=eps)
        super().__init__(params, defaults)

    def _update(self, p, g, group, state, copy, code, threads):  # type: ignore[no-untyped-def]
        if "sum" not in state:
            state["sum"] = torch.full_like(p, float(group["initial_accumulator_value"]),
                                           memory_format=torch.contiguous_format)
        _check_param(state["sum"], "DscoreCPUAdagrad state")
        step = _next_step(state)
        clr = float(group["lr"]) / (1.0 + (step - 1) * float(group["lr_decay"]))
        self._op.adagrad_update(
            p.data_ptr(), g.data_ptr(), state["sum"].data_ptr(), p.numel(), -clr, float(group["eps"]),
            float(group["weight_decay"]), copy, code, threads,
        )


class DscoreCPULion(_CPUOptimizer):
    """Lion (Chen et al. 2023) on fp32 CPU parameters through the ``cpu_lion`` op.

    Update: ``c = beta1*m + (1-beta1)*g; p = p*(1 - lr*wd) - lr*sign(c); m = beta2*m + (1-beta2)*g``.

    Args:
        params: iterable of contiguous fp32 CPU tensors or param-group dicts.
        lr: learning rate (Lion wants 3-10x smaller than AdamW).
        betas: ``(beta1, beta2)``: interpolation for the update sign, and momentum decay.
        weight_decay: decoupled weight decay.

    State per parameter: ``exp_avg`` (fp32, param's shape) and ``step``.

    Raises:
        ConfigError: a hyperparameter out of range.
        OpBuildError: a parameter is not a contiguous fp32 CPU tensor, or the op cannot be built.
    """

    _OP = "cpu_lion"

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
    ) -> None:
        _check_range(lr=lr, weight_decay=weight_decay, beta1=betas[0], beta2=betas[1])
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    def _update(self, p, g, group, state, copy, code, threads):  # type: ignore[no-untyped-def]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        _check_param(state["exp_avg"], "DscoreCPULion state")
        _next_step(state)
        lr, wd = float(group["lr"]), float(group["weight_decay"])
        beta1, beta2 = (float(b) for b in group["betas"])
        self._op.lion_update(
            p.data_ptr(), g.data_ptr(), state["exp_avg"].data_ptr(), p.numel(), beta1, 1.0 - beta1, beta2,
            1.0 - beta2, -lr, 1.0 - lr * wd, copy, code, threads,
        )


def _check_range(**values: float) -> None:
    for key, value in values.items():
        bad = value < 0.0 or (key.startswith("beta") and value >= 1.0)
        if bad:
            valid = "in [0, 1)" if key.startswith("beta") else ">= 0"
            raise ConfigError(f"optimizer parameter {key}={value!r} is invalid; it must be {valid}",
                              path=f"optimizer.params.{key}")


# OptimizerSpec factories (``factory(param_groups, ctx)``): every value from the validated params model.
def build_cpu_adam(param_groups: list[dict[str, Any]], ctx: OptimizerContext[CPUAdamParams]) -> DscoreCPUAdam:
    """``DscoreCPUAdam`` from the validated ``optimizer.params``."""
    p = ctx.section
    return DscoreCPUAdam(
        param_groups, lr=p.lr, betas=p.betas, eps=p.eps, weight_decay=p.weight_decay, amsgrad=p.amsgrad,
        adamw_mode=p.adamw_mode, bias_correction=p.bias_correction,
    )


def build_cpu_adagrad(param_groups: list[dict[str, Any]], ctx: OptimizerContext[AdagradParams]) -> DscoreCPUAdagrad:
    """``DscoreCPUAdagrad`` from the validated ``optimizer.params``."""
    p = ctx.section
    return DscoreCPUAdagrad(
        param_groups, lr=p.lr, lr_decay=p.lr_decay, weight_decay=p.weight_decay,
        initial_accumulator_value=p.initial_accumulator_value, eps=p.eps,
    )


def build_cpu_lion(param_groups: list[dict[str, Any]], ctx: OptimizerContext[LionParams]) -> DscoreCPULion:
    """``DscoreCPULion`` from the validated ``optimizer.params``."""
    p = ctx.section
    return DscoreCPULion(param_groups, lr=p.lr, betas=p.betas, weight_decay=p.weight_decay)
