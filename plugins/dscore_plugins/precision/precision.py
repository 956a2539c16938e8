"""The precision modes: fp32, fp16 (static or dynamic loss scaling) and bf16.

Each factory takes the whole validated ``DscoreConfig`` and reads its ``fp16`` / ``bf16`` block
(DeepSpeed's keys and defaults, ``deepspeed-behaviour.md`` §2.5). The ZeRO stage asks the mode for a
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
from dscore_plugins.precision.loss_scaler import DynamicLossScaler, StaticLossScaler

if TYPE_CHECKING:
    import torch

__all__ = ["Fp32Mode", "Fp16Mode", "Bf16Mode", "FP16_DEFAULTS", "BF16_DEFAULTS"]

log = logging.getLogger("dscore.precision")

#: DeepSpeed 0.19.8 defaults of the ``fp16`` block (used for keys a config object lacks).
FP16_DEFAULTS: dict[str, Any] = {
    "enabled": False,
    "loss_scale": 0.0,
    "initial_scale_power": 16,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "consecutive_hysteresis": False,
    "min_loss_scale": 1.0,
}
#: DeepSpeed 0.19.8 defaults of the ``bf16`` block.
BF16_DEFAULTS: dict[str, Any] = {"enabled": False, "check_grad_overflow": True}


def _read(config: Any, section: str, key: str, defaults: dict[str, Any]) -> Any:
    """``config.<section>.<key>``, accepting dict configs and absent sections (-> DeepSpeed default)."""
    block = config.get(section) if isinstance(config, dict) else getattr(config, section, None)
    if block is None:
        return defaults[key]
    value = block.get(key, defaults[key]) if isinstance(block, dict) else getattr(block, key, defaults[key])
    return defaults[key] if value is None else value


def _cast_module(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Cast floating-point parameters and buffers of ``module`` to ``dtype`` in place (ints untouched)."""
    return module.to(dtype=dtype)


class Fp32Mode(PrecisionMode):
    """Full precision: no casting, no loss scaling, no overflow check.

    Args:
        config: the validated DscoreConfig (unused; accepted for the common factory signature).
    """

    name: ClassVar[str] = "fp32"
    check_overflow = False

    def __init__(self, config: Any = None) -> None:
        self.config = config

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

    Reads ``config.fp16``: ``loss_scale`` (0 = dynamic), ``initial_scale_power`` (initial scale
    ``2**power``), ``loss_scale_window``, ``hysteresis``, ``consecutive_hysteresis``, ``min_loss_scale``.

    Args:
        config: the validated DscoreConfig.
    """

    name: ClassVar[str] = "fp16"
    check_overflow = True

    def __init__(self, config: Any) -> None:
        self.config = config
        self.loss_scale = float(_read(config, "fp16", "loss_scale", FP16_DEFAULTS))
        self.initial_scale_power = int(_read(config, "fp16", "initial_scale_power", FP16_DEFAULTS))
        self.loss_scale_window = float(_read(config, "fp16", "loss_scale_window", FP16_DEFAULTS))
        self.hysteresis = int(_read(config, "fp16", "hysteresis", FP16_DEFAULTS))
        self.consecutive_hysteresis = bool(_read(config, "fp16", "consecutive_hysteresis", FP16_DEFAULTS))
        self.min_loss_scale = float(_read(config, "fp16", "min_loss_scale", FP16_DEFAULTS))

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

    ``config.bf16.check_grad_overflow`` (default true, DeepSpeed 0.19.x) makes the ZeRO stage skip steps
    whose gradients hold inf/NaN, like fp16 does.

    Args:
        config: the validated DscoreConfig.
    """

    name: ClassVar[str] = "bf16"

    def __init__(self, config: Any) -> None:
        self.config = config
        self.check_overflow = bool(_read(config, "bf16", "check_grad_overflow", BF16_DEFAULTS))

    @property
    def compute_dtype(self) -> torch.dtype:
        import torch

        return torch.bfloat16

    def make_loss_scaler(self, *, zero_stage: int) -> LossScaler | None:
        return None

    def prepare_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return _cast_module(module, self.compute_dtype)
