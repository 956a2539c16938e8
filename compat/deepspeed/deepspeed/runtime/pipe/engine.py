"""``deepspeed.runtime.pipe.engine``: ``PipelineEngine``, the engine ``deepspeed.initialize`` returns for a
``PipelineModule``.

dscore's pipeline engine is its engine plugin's ``pipeline`` unit, selected by the model's type; it is not
constructed directly. So :class:`PipelineEngine` here is a type to test against:
``isinstance(engine, PipelineEngine)`` is true for a dscore engine (:class:`dscore.runtime.engine.DscoreEngine`)
whose module is a :class:`dscore.pipe.PipelineModule`; calling ``PipelineEngine(...)`` raises
:class:`NotProvidedError` (build it with ``deepspeed.initialize(model=pipeline_module, ...)``).
"""

from __future__ import annotations

from typing import Any, NoReturn

from deepspeed._not_provided import NotProvidedError
from dscore.pipe import PipelineModule
from dscore.runtime.engine import DscoreEngine

__all__ = ["PipelineEngine"]


class _PipelineEngineType(type):
    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, DscoreEngine) and isinstance(getattr(obj, "module", None), PipelineModule)

    def __call__(cls, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotProvidedError(
            "deepspeed.runtime.pipe.engine.PipelineEngine(...) (DeepSpeed 0.19.8) is not constructed directly in "
            "dscore: deepspeed.initialize(model=<a PipelineModule>, config=...) returns the pipeline engine"
        )


class PipelineEngine(metaclass=_PipelineEngineType):
    """The pipeline engine's type (see the module docstring); ``train_batch(data_iter)`` /
    ``eval_batch(data_iter)`` are on the engine ``deepspeed.initialize`` returns."""
