"""``deepspeed.runtime.zero.linear``: ZeRO-3's linear layer names of DeepSpeed 0.19.8.

DeepSpeed routes ``nn.Linear`` through its own autograd function under ZeRO-3 (``memory_efficient_linear``) so
the weight is not kept alive by autograd; dscore's stage 3 does not need it (it gathers and releases whole
units around the forward and backward), so these are plain linear maps with the same results and gradients:
``y = x @ weight.T + bias`` for ``x`` of shape ``(*, in_features)``, ``weight`` ``(out_features, in_features)``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["LinearFunctionForZeroStage3", "LinearModuleForZeroStage3", "zero3_linear_wrap"]


class LinearFunctionForZeroStage3(torch.autograd.Function):
    """``apply(input, weight, bias=None)``: the linear map with its gradients for input, weight and bias."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        ctx.save_for_backward(input, weight, bias)
        return F.linear(input, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        input, weight, bias = ctx.saved_tensors
        grad_input = grad_output.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_weight = grad_bias = None
        if ctx.needs_input_grad[1]:
            grad_weight = grad_output.reshape(-1, grad_output.shape[-1]).t().matmul(input.reshape(-1, input.shape[-1]))
        if bias is not None and ctx.needs_input_grad[2]:
            grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0)
        return grad_input, grad_weight, grad_bias


def zero3_linear_wrap(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """:class:`LinearFunctionForZeroStage3` applied (``bias`` optional)."""
    if bias is None:
        return LinearFunctionForZeroStage3.apply(input, weight)
    return LinearFunctionForZeroStage3.apply(input, weight, bias)


class LinearModuleForZeroStage3(torch.nn.Linear):
    """``torch.nn.Linear`` whose forward is :func:`zero3_linear_wrap` (same parameters, initialisation and
    ``state_dict`` keys)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return zero3_linear_wrap(input, self.weight, self.bias)
