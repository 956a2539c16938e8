"""Pydantic models of ``optimizer.params`` for the op-backed optimizers (torch-free).

Keys and defaults are DeepSpeed 0.19.8's constructors (``DeepSpeedCPUAdam``, ``DeepSpeedCPUAdagrad``,
``DeepSpeedCPULion``, ``FusedAdam``, ``FusedLamb``, ``FusedLion``). Adagrad and Lion share the models of
the ``adagrad``/``lion`` optimizers; every model refuses unknown keys and ``max_grad_norm``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import StrictBool

from dscore.config.base import NonNegativeFloat, PositiveFloat
from dscore_plugins.optim.config import AdagradParams, AdamFamilyParams, LionParams

__all__ = ["AdagradParams", "CPUAdamParams", "FusedAdamParams", "FusedLambParams", "LionParams"]


class CPUAdamParams(AdamFamilyParams):
    """``DscoreCPUAdam`` (DeepSpeed's ``DeepSpeedCPUAdam``): Adam/AdamW stepping fp32 CPU tensors."""

    amsgrad: Literal[False] = False
    """Not supported (as DeepSpeed's CPU Adam)."""
    adamw_mode: StrictBool = True
    """Decoupled weight decay (AdamW)."""
    fp32_optimizer_states: StrictBool = True
    """Accepted for DeepSpeed compatibility (states are always fp32 here)."""


class FusedAdamParams(AdamFamilyParams):
    """``FusedAdam``: multi-tensor Adam/AdamW on CUDA (DeepSpeed's defaults)."""

    adam_w_mode: StrictBool = True
    """Decoupled weight decay (AdamW)."""
    amsgrad: Literal[False] = False
    """Not supported (as DeepSpeed's FusedAdam)."""
    set_grad_none: StrictBool = True
    """Accepted for compatibility (the engine always sets ``grad = None``)."""


class FusedLambParams(AdamFamilyParams):
    """``FusedLamb``: multi-tensor LAMB on CUDA (DeepSpeed's defaults; ``weight_decay`` is added to the
    update before the trust ratio)."""

    max_coeff: PositiveFloat = 10.0
    """Upper clamp of the trust ratio."""
    min_coeff: NonNegativeFloat = 0.01
    """Lower clamp of the trust ratio."""
