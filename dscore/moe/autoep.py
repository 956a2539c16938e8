"""AutoEP: expert parallelism for Hugging Face MoE blocks (``expert_parallel`` in ds_config).

The machinery is the ``autoep`` model transform of the built-in ``parallel`` plugin; this module's names
(``AutoEPMoELayer``, ``hf_state_dict``, ...) resolve through the registry on first access
(:func:`dscore.exports.thin_getattr`), so they follow ``DSCORE_DISABLE_PLUGINS=model_transform:autoep``.
"""

from __future__ import annotations

# ruff: noqa: F822 - the names of __all__ resolve through __getattr__ (a thin module)
from typing import Any

from dscore.exports import thin_getattr

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

_resolve = thin_getattr(__name__, "model_transform", "autoep", __all__)


def __getattr__(name: str) -> Any:
    """Resolve one of ``__all__`` through the registry on first access (then a plain module attribute)."""
    return _resolve(name)
