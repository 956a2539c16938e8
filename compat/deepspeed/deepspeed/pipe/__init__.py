"""``deepspeed.pipe`` (what DeepSpeed's pipeline tutorial imports): ``PipelineModule``, ``LayerSpec``,
``TiedLayerSpec`` (:mod:`deepspeed.runtime.pipe.module`, on :mod:`dscore.pipe`). ``DualPipeVModule``
(DeepSpeed's DualPipeV schedule) is not provided: using it raises :class:`NotProvidedError`."""

from __future__ import annotations

from deepspeed._not_provided import not_provided
from deepspeed.runtime.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["DualPipeVModule", "LayerSpec", "PipelineModule", "TiedLayerSpec"]

DualPipeVModule = not_provided(
    "deepspeed.pipe.DualPipeVModule",
    "dscore's pipeline engine runs the 1F1B schedule only; use PipelineModule",
)
