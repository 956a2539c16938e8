"""The precision modes: fp32, fp16 (static or dynamic loss scaling) and bf16.

Each factory receives a :class:`dscore.protocols.PrecisionContext` whose ``section`` is the validated
``fp16`` / ``bf16`` block (:mod:`dscore_plugins.precision.config`: DeepSpeed's keys and defaults,
``deepspeed-behaviour.md`` §2.5 — the defaults live there only). The ZeRO stage asks the mode for a
loss scaler (:meth:`PrecisionMode.make_loss_scaler`) and whether to check gradients for inf/NaN
(:attr:`PrecisionMode.check_overflow`); gradient clipping is done by the ZeRO stage identically for
every mode (on unscaled gradients).

Mirrors DeepSpeed's ``CreateLossScaler`` (``deepspeed/runtime/fp16/loss_scaler.py``): fp16 with
``loss_scale == 0`` is dynamic, fp16 with ``loss_scale > 0`` is static, every other mode has no
scaling. bf16 with ``check_grad_overflow`` (default true) skips steps with non-finite gradients.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, ClassVar

from dscore.protocols.precision import LossScaler, PrecisionMode
from dscore_plugins.precision.config import Bf16Config, Fp16Config
from dscore_plugins.precision.loss_scaler import DynamicLossScaler, StaticLossScaler

if TYPE_CHECKING:
    import torch

    from dscore.protocols import PrecisionContext

__all__ = ["Bf16Mode", "Fp16Mode", "Fp32Mode", "build_bf16", "build_fp16", "build_fp32"]

log = logging.getLogger("dscore.precision")


def _cast_module(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Cast floating-point parameters and buffers of ``module`` to ``dtype`` in place (ints untouched),
    keeping every ``Parameter`` object (:func:`dscore.runtime.placement.to_module`)."""
    from dscore.runtime.placement import to_module

    return to_module(module, dtype=dtype)


class Fp32Mode(PrecisionMode):
    """Full precision: no casting, no loss scaling, no overflow check."""

    name: ClassVar[str] = "fp32"
    check_overflow = False

    @property
    def compute_dtype(self) -> torch.dtype:
        import torch

        return torch.float32

    def make_loss_scaler(self, *, zero_stage: int) -> LossScaler | None:
        return None

    def prepare_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module


class Fp16Mode(PrecisionMode):
    """fp16 parameters and activations with loss scaling; overflowing steps are skipped.

    Reads the ``fp16`` block: ``loss_scale`` (0 = dynamic), ``initial_scale_power`` (initial scale
    ``2**power``), ``loss_scale_window``, ``hysteresis``, ``consecutive_hysteresis``, ``min_loss_scale``.

    Args:
        section: the validated ``fp16`` block (default: the block's defaults, dynamic scaling).
    """

    name: ClassVar[str] = "fp16"
    check_overflow = True

    def __init__(self, section: Fp16Config | None = None) -> None:
        self.section = section if section is not None else Fp16Config()
        self.loss_scale = float(self.section.loss_scale)
        self.initial_scale_power = int(self.section.initial_scale_power)
        self.loss_scale_window = float(self.section.loss_scale_window)
        self.hysteresis = int(self.section.hysteresis)
        self.consecutive_hysteresis = bool(self.section.consecutive_hysteresis)
        self.min_loss_scale = float(self.section.min_loss_scale)

    @property
    def dynamic(self) -> bool:
        """True when ``fp16.loss_scale == 0``."""
        return self.loss_scale == 0

    @property
    def compute_dtype(self) -> torch.dtype:
        import torch

        return torch.float16

    def make_loss_scaler(self, *, zero_stage: int) -> LossScaler:
        """A :class:`StaticLossScaler`, or a :class:`DynamicLossScaler` whose algorithm is ``"fp16_optimizer"``
        for ``zero_stage == 0`` and ``"zero"`` for stages 1-3."""
        if not self.dynamic:
            return StaticLossScaler(self.loss_scale)
        algorithm = "fp16_optimizer" if zero_stage == 0 else "zero"
        return DynamicLossScaler(
            init_scale=2.0**self.initial_scale_power,
            scale_window=self.loss_scale_window,
            min_scale=self.min_loss_scale,
            hysteresis=self.hysteresis,
            consecutive_hysteresis=self.consecutive_hysteresis,
            algorithm=algorithm,
        )

    def prepare_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return _cast_module(module, self.compute_dtype)


class Bf16Mode(PrecisionMode):
    """bf16 parameters and activations; no loss scaling.

    ``bf16.check_grad_overflow`` (default true, DeepSpeed 0.19.x) makes the ZeRO stage skip steps
    whose gradients hold inf/NaN, like fp16 does.

    Args:
        section: the validated ``bf16`` block (default: the block's defaults).
    """

    name: ClassVar[str] = "bf16"

    def __init__(self, section: Bf16Config | None = None) -> None:
        self.section = section if section is not None else Bf16Config()
        self.check_overflow = bool(self.section.check_grad_overflow)

    @property
    def compute_dtype(self) -> torch.dtype:
        import torch

        return torch.bfloat16

    def make_loss_scaler(self, *, zero_stage: int) -> LossScaler | None:
        return None

    def prepare_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return _cast_module(module, self.compute_dtype)


# PrecisionSpec factories: ``factory(ctx: PrecisionContext)``.
def build_fp32(ctx: PrecisionContext[Any]) -> Fp32Mode:
    """The default mode (no config block)."""
    return Fp32Mode()


def build_fp16(ctx: PrecisionContext[Fp16Config]) -> Fp16Mode:
    """fp16 from the validated ``fp16`` block."""
    return Fp16Mode(ctx.section)


def build_bf16(ctx: PrecisionContext[Bf16Config]) -> Bf16Mode:
    """bf16 from the validated ``bf16`` block."""
    return Bf16Mode(ctx.section)
