"""The ``tensor_parallel`` ds_config section model (AutoTP's section), torch-free.

The model belongs to the built-in ``parallel`` plugin, which registers the section; these names resolve on
first access through its ``config_section:tensor_parallel`` unit (:func:`dscore.exports.thin_getattr`).
"""

from __future__ import annotations

# ruff: noqa: F822 - the names of __all__ resolve through __getattr__ (a thin module)
from typing import Any

from dscore.exports import thin_getattr

__all__ = [
    "LayerSpecConfig",
    "PartitionConfig",
    "TensorParallelConfig",
    "PRESET_MODELS",
]

_resolve = thin_getattr(__name__, "config_section", "tensor_parallel", __all__)


def __getattr__(name: str) -> Any:
    """Resolve one of ``__all__`` through the registry on first access (then a plain module attribute)."""
    return _resolve(name)
