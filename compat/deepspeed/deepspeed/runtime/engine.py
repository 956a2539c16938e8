"""``deepspeed.runtime.engine``: ``DeepSpeedEngine`` is :class:`dscore.runtime.engine.DscoreEngine`, so the
engine ``deepspeed.initialize`` returns is an instance of it."""

from __future__ import annotations

from dscore.runtime.engine import DscoreEngine as DeepSpeedEngine
from dscore.runtime.engine import EngineError

__all__ = ["DeepSpeedEngine", "EngineError"]
