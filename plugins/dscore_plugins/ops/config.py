"""Pydantic models of ``optimizer.params`` for the op-backed optimizers (torch-free).

Keys and defaults are DeepSpeed 0.19.8's constructors (``DeepSpeedCPUAdam``, ``DeepSpeedCPUAdagrad``,
``DeepSpeedCPULion``, ``FusedAdam``, ``FusedLamb``, ``FusedLion``). Adagrad and Lion share the models of
the ``adagrad``/``lion`` optimizers; every model refuses unknown keys and ``max_grad_norm``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import StrictBool

from dscore.config.base import NonNegativeFloat, PositiveFloat
from dscore_plugins.optim.config import AdagradParams, Betas, LionParams, OptimizerParams

__all__ = ["AdagradParams", "CPUAdamParams", "FusedAdamParams", "FusedLambParams", "LionParams"]


class CPUAdamParams(OptimizerParams):
    """``DscoreCPUAdam`` (DeepSpeed's ``DeepSpeedCPUAdam``): Adam/AdamW stepping fp32 CPU tensors."""

    lr: NonNegativeFloat = 1e-3
    """Learning rate."""
    bias_correction: StrictBool = True
    """Divide the moments by ``1 - beta^t``."""
    betas: Betas = (0.9, 0.999)
    """Coefficients of the running averages of the gradient and its square."""
    eps: PositiveFloat = 1e-8
    """Added to the bias-corrected ``sqrt(exp_avg_sq)``."""
    weight_decay: NonNegativeFloat = 0.0
    """Decoupled (``adamw_mode``) or L2 added to the gradient."""
    amsgrad: Literal[False] = False
    """Not supported (as DeepSpeed's CPU Adam)."""
    adamw_mode: StrictBool = True
    """Decoupled weight decay (AdamW)."""
    fp32_optimizer_states: StrictBool = True
    """Accepted for DeepSpeed compatibility (states are always fp32 here)."""


class FusedAdamParams(OptimizerParams):
    """``FusedAdam``: multi-tensor Adam/AdamW on CUDA (DeepSpeed's defaults)."""

    lr: NonNegativeFloat = 1e-3
    """Learning rate."""
    bias_correction: StrictBool = True
    """Divide the moments by ``1 - beta^t``."""
    betas: Betas = (0.9, 0.999)
    """Moment coefficients."""
    eps: PositiveFloat = 1e-8
    """Denominator term."""
    adam_w_mode: StrictBool = True
    """Decoupled weight decay (AdamW)."""
    weight_decay: NonNegativeFloat = 0.0
    """Weight decay."""
    amsgrad: Literal[False] = False
    """Not supported (as DeepSpeed's FusedAdam)."""
    set_grad_none: StrictBool = True
    """Accepted for compatibility (the engine always sets ``grad = None``)."""


class FusedLambParams(OptimizerParams):
    """``FusedLamb``: multi-tensor LAMB on CUDA (DeepSpeed's defaults)."""

    lr: NonNegativeFloat = 1e-3
    """Learning rate."""
    bias_correction: StrictBool = True
    """Divide the moments by ``1 - beta^t``."""
    betas: Betas = (0.9, 0.999)
    """Moment coefficients."""
    eps: PositiveFloat = 1e-8
    """Denominator term."""
    weight_decay: NonNegativeFloat = 0.0
    """Added to the update before the trust ratio."""
    max_coeff: PositiveFloat = 10.0
    """Upper clamp of the trust ratio."""
    min_coeff: NonNegativeFloat = 0.01
    """Lower clamp of the trust ratio."""
