"""Ulysses sequence parallelism (ALST) with DeepSpeed's names: ``UlyssesSPAttentionHF``,
``UlyssesSPDataLoaderAdapter``, ``all_gather_differentiable``, ``TiledMLP``, ``sequence_tiled_compute``, ...

The machinery is the ``ulysses`` model transform of the built-in ``parallel`` plugin; this module's names
resolve through the registry on first access (:func:`dscore.exports.thin_getattr`), so they follow
``DSCORE_DISABLE_PLUGINS=model_transform:ulysses``.
"""

from __future__ import annotations

# ruff: noqa: F822 - the names of __all__ resolve through __getattr__ (a thin module)
from typing import Any

from dscore.exports import thin_getattr

__all__ = [
    "as_comm",
    "require_ulysses_attention",
    "TiledMLP",
    "UlyssesSPAttentionHF",
    "UlyssesSPDataLoaderAdapter",
    "all_gather_differentiable",
    "heads_to_seq",
    "seq_to_heads",
    "sequence_tiled_compute",
]

_resolve = thin_getattr(__name__, "model_transform", "ulysses", __all__)


def __getattr__(name: str) -> Any:
    """Resolve one of ``__all__`` through the registry on first access (then a plain module attribute)."""
    return _resolve(name)
