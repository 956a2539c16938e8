"""``deepspeed.runtime.pipe``: pipeline parallelism on :mod:`dscore.pipe` (``module``, ``topology``; the
``schedule`` and ``engine`` names are importable, see those modules)."""

from __future__ import annotations

from deepspeed.runtime.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import ProcessTopology

__all__ = ["LayerSpec", "PipelineModule", "ProcessTopology", "TiedLayerSpec"]
