"""The precision contract: how a model is cast for compute and how the loss is scaled.

A :class:`PrecisionMode` (plugin kind ``precision``) says how the model is cast and how the loss is scaled;
a ZeRO stage asks it for the :class:`LossScaler` and reports overflows to it. Mirrors DeepSpeed's
fp16/bf16 blocks and its ``LossScaler``/``DynamicLossScaler`` (``deepspeed/runtime/fp16/loss_scaler.py``).
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

__all__ = ["LossScaler", "PrecisionMode"]


class LossScaler(abc.ABC):
    """Loss scale state for fp16 training (static or dynamic).

    ``loss_scale`` is the factor the loss is multiplied by before backward (a Python float). ``update``
    is called once per gradient accumulation boundary with whether any gradient was inf/NaN, and returns
    True when the optimizer step must be skipped. Algorithms and their sources are documented by the
    implementing plugin (DeepSpeed ``deepspeed/runtime/fp16/loss_scaler.py``).
    """

    @property
    @abc.abstractmethod
    def loss_scale(self) -> float:
        """The current scale (>= 1 for dynamic scaling)."""

    @abc.abstractmethod
    def update(self, overflow: bool) -> bool:
        """Record one boundary; return True when the step must be skipped.

        Raises:
            FloatingPointError: the ZeRO algorithm reached ``min_loss_scale`` and still overflows.
        """

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """JSON-like state (floats and ints) for checkpoints."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""


class PrecisionMode(abc.ABC):
    """How parameters are stored for compute and how the loss is scaled.

    Attributes:
        name: ``"fp32"``, ``"fp16"`` or ``"bf16"``.
        check_overflow: True when gradients must be checked for inf/NaN at each boundary (fp16 always,
            bf16 when ``bf16.check_grad_overflow``).
    """

    name: ClassVar[str]
    check_overflow: bool = False

    @property
    @abc.abstractmethod
    def compute_dtype(self) -> torch.dtype:
        """dtype of the module's parameters during forward/backward."""

    @abc.abstractmethod
    def make_loss_scaler(self, *, zero_stage: int) -> LossScaler | None:
        """A new loss scaler for one engine, or None when the mode needs none (fp32, bf16).

        ``zero_stage`` selects DeepSpeed's algorithm: stage 0 uses the fp16-optimizer rules (halve at once,
        no hysteresis), stages 1-3 the ZeRO rules (hysteresis, error at the minimum scale).
        """

    @abc.abstractmethod
    def prepare_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Cast the module's floating-point parameters and buffers to :attr:`compute_dtype` (in place)."""
