"""AutoEP (the ``autoep`` model transform's machinery and the names ``dscore.moe.autoep`` exports).

* :mod:`.routing`: model-family presets, the resolved :class:`LayerSpec`, the top-k router (:func:`route`);
* :mod:`.layer`: :class:`AutoEPMoELayer`, the expert-parallel block (local experts, token exchange, combine);
* :mod:`.convert`: detection and replacement of a model's MoE blocks, parameter remapping, ``hf_state_dict``.
"""

from __future__ import annotations

from dscore_plugins.parallel.autoep.convert import apply_autoep, detect_moe_layers, hf_state_dict, remap_parameters
from dscore_plugins.parallel.autoep.layer import AutoEPMoELayer
from dscore_plugins.parallel.autoep.routing import PRESETS, LayerSpec, Preset, route

__all__ = [
    "AutoEPMoELayer",
    "LayerSpec",
    "Preset",
    "PRESETS",
    "apply_autoep",
    "detect_moe_layers",
    "hf_state_dict",
    "remap_parameters",
    "route",
]
