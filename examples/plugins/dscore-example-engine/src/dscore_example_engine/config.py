"""The ``ema`` ds_config section (torch-free)."""

from __future__ import annotations

from pydantic import Field, StrictBool

from dscore.config.base import SectionModel


class EmaConfig(SectionModel):
    """``ema``: keep an exponential moving average of the trainable weights."""

    enabled: StrictBool = False
    """Use the ``ema`` engine."""
    decay: float = Field(0.999, gt=0.0, lt=1.0)
    """Weight of the old average at each applied optimizer step."""
