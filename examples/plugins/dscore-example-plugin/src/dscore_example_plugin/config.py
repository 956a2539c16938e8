"""Parameter models of the example plugin (validated by dscore with the same strictness as built-ins)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class SignSGDParams(BaseModel):
    """``optimizer.params`` of ``SignSGD``."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    lr: float = Field(default=1e-3, gt=0)
    """Step size: each parameter moves by exactly ``lr`` per step (times the sign)."""
    momentum: float = Field(default=0.9, ge=0, lt=1)
    """EMA factor of the gradient whose sign is taken (0 = plain signSGD)."""
    weight_decay: float = Field(default=0.0, ge=0)
    """Decoupled weight decay, applied as ``p -= lr * weight_decay * p``."""


class InverseSqrtLRParams(BaseModel):
    """``scheduler.params`` of ``InverseSqrtLR``."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    warmup_num_steps: int = Field(default=1000, gt=0)
    """Steps of linear warm-up from 0 to the optimizer's lr."""
