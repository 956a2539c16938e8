"""``deepspeed.runtime.hybrid_engine``: ``DeepSpeedHybridEngine``, the engine ``deepspeed.initialize`` returns when
``hybrid_engine.enabled`` is true.

dscore's hybrid engine is its engine plugin's ``hybrid`` unit, selected by the config block; it is not
constructed directly. So :class:`DeepSpeedHybridEngine` here is a type to test against: ``isinstance(engine,
DeepSpeedHybridEngine)`` is true for a dscore engine (:class:`dscore.runtime.engine.DscoreEngine`) built with the
``hybrid_engine`` block enabled (it has ``generate``, ``eval``/``train`` and DeepSpeed's latency counters); calling
``DeepSpeedHybridEngine(...)`` raises :class:`NotProvidedError`.
"""

from __future__ import annotations

from typing import Any, NoReturn

from deepspeed._not_provided import NotProvidedError
from dscore.runtime.engine import DscoreEngine

__all__ = ["DeepSpeedHybridEngine"]


class _HybridEngineType(type):
    def __instancecheck__(cls, obj: Any) -> bool:
        if not isinstance(obj, DscoreEngine) or not callable(getattr(type(obj), "generate", None)):
            return False
        section = obj.config.section("hybrid_engine", None)
        return bool(section is not None and section.enabled)

    def __call__(cls, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotProvidedError(
            "deepspeed.runtime.hybrid_engine.DeepSpeedHybridEngine(...) (DeepSpeed 0.19.8) is not constructed "
            'directly in dscore: deepspeed.initialize(model=..., config={..., "hybrid_engine": {"enabled": true}}) '
            "returns the hybrid engine"
        )


class DeepSpeedHybridEngine(metaclass=_HybridEngineType):
    """The hybrid engine's type (see the module docstring); ``generate(...)``, ``eval()``, ``train()`` are on the
    engine ``deepspeed.initialize`` returns."""
