"""The ``fp16``, ``bf16`` (legacy ``bfloat16``) and ``torch_autocast`` sections (torch-free).

Defaults and validation mirror DeepSpeed 0.19.8 ``deepspeed/runtime/precision_config.py``: ``loss_scale``
0 means dynamic scaling; ``loss_scale_window`` and ``min_loss_scale`` must be > 0 when dynamic scaling
is on; ``bf16.check_grad_overflow`` defaults to true (0.19.x). The cross checks with ZeRO (master weights
need stage >= 1, fp16 and bf16 exclusive) are made by :mod:`dscore.config.checks`.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from dscore.config.base import Float, Int, NonNegativeFloat, SectionModel, not_implemented

__all__ = ["Fp16Config", "Bf16Config", "TorchAutocastConfig"]

_AUTOCAST_DTYPES = {
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "torch.float16": "fp16",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "torch.bfloat16": "bf16",
    "fp32": "fp32",
    "float": "fp32",
    "float32": "fp32",
    "torch.float32": "fp32",
    "int8": "int8",
    "torch.int8": "int8",
}


class Fp16Config(SectionModel):
    """``fp16``: train in float16 with loss scaling."""

    enabled: bool = False
    """Train with fp16 parameters and activations."""
    auto_cast: bool = False
    """Cast floating-point inputs of the model's forward to fp16."""
    loss_scale: NonNegativeFloat = 0.0
    """Static loss scale; 0 selects dynamic loss scaling."""
    initial_scale_power: Int = 16
    """Dynamic scaling starts at 2**initial_scale_power."""
    loss_scale_window: Float = 1000
    """Overflow-free steps before the dynamic scale is doubled."""
    hysteresis: Int = 2
    """Overflows tolerated before the scale is lowered (ZeRO's scaler; see the precision plugin)."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis budget after every overflow-free step."""
    min_loss_scale: Float = 1
    """Lower bound of the dynamic scale."""
    fp16_master_weights_and_grads: bool = False
    """Keep master weights and gradients in fp16 (ZeRO stage >= 1 only)."""

    @model_validator(mode="after")
    def _dynamic(self) -> Fp16Config:
        if self.enabled and self.loss_scale == 0:
            if self.loss_scale_window <= 0:
                raise ValueError(
                    f"loss_scale_window must be > 0 with dynamic loss scaling, got {self.loss_scale_window}"
                )
            if self.min_loss_scale <= 0:
                raise ValueError(f"min_loss_scale must be > 0 with dynamic loss scaling, got {self.min_loss_scale}")
        return self

    def dynamic_loss_scale_args(self) -> dict[str, Any]:
        """DeepSpeed's dynamic-scaler arguments: ``init_scale`` (2**initial_scale_power), ``scale_window``,
        ``delayed_shift`` (hysteresis), ``consecutive_hysteresis``, ``min_scale``."""
        return {
            "init_scale": 2.0**self.initial_scale_power,
            "scale_window": self.loss_scale_window,
            "delayed_shift": self.hysteresis,
            "consecutive_hysteresis": self.consecutive_hysteresis,
            "min_scale": self.min_loss_scale,
        }


class Bf16Config(SectionModel):
    """``bf16`` (legacy key ``bfloat16``): train in bfloat16, no loss scaling."""

    enabled: bool = False
    """Train with bf16 parameters and activations."""
    immediate_grad_update: bool = Field(
        False, json_schema_extra=not_implemented("accumulating bf16 gradients into fp32 during backward")
    )
    """Apply gradients to the fp32 master copy as soon as they are produced."""
    check_grad_overflow: bool = True
    """Skip the step when a gradient is inf/NaN (default true since DeepSpeed 0.19)."""
    bf16_master_weights_and_grads: bool = False
    """Keep master weights and gradients in bf16 (ZeRO stage >= 1 only)."""
    bf16_optimizer_states: bool = False
    """Keep optimizer states in bf16 (needs bf16_master_weights_and_grads and ZeRO stage >= 1)."""


class TorchAutocastConfig(SectionModel):
    """``torch_autocast``: run the forward under ``torch.autocast``."""

    enabled: bool = False
    """Use torch.autocast in forward."""
    dtype: str | None = None
    """Autocast dtype: ``fp16``/``float16``/``half``, ``bf16``/``bfloat16``, ``fp32``/``float``, ``int8``
    (case-insensitive, stored canonical); ``None`` = the accelerator's default."""
    lower_precision_safe_modules: list[str] | None = Field(
        None, json_schema_extra=not_implemented("per-module low-precision communication under torch_autocast")
    )
    """Qualified class names of modules whose weights may be communicated in the lower precision."""

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype(cls, value: Any) -> Any:
        if value is None:
            return None
        canonical = _AUTOCAST_DTYPES.get(value.strip().lower()) if isinstance(value, str) else None
        if canonical is None:
            raise ValueError(
                f"expected one of {sorted(set(_AUTOCAST_DTYPES.values()))} (or a torch spelling), got {value!r}"
            )
        return canonical
