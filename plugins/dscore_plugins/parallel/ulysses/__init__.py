"""Ulysses sequence parallelism (the ``ulysses`` model transform's machinery and the names
``dscore.parallel.ulysses`` exports).

* :mod:`.attention`: the all-to-all around attention (:class:`UlyssesSPAttentionHF`, :func:`seq_to_heads`,
  :func:`heads_to_seq`) and the check that a sequence-parallel model really runs it;
* :mod:`.data`: :class:`UlyssesSPDataLoaderAdapter` and :func:`all_gather_differentiable`;
* :mod:`.tiled`: :class:`TiledMLP` and :func:`sequence_tiled_compute`.
"""

from __future__ import annotations

from dscore_plugins.parallel.ulysses.attention import (
    UlyssesSPAttentionHF,
    as_comm,
    heads_to_seq,
    require_ulysses_attention,
    seq_to_heads,
)
from dscore_plugins.parallel.ulysses.data import UlyssesSPDataLoaderAdapter, all_gather_differentiable
from dscore_plugins.parallel.ulysses.tiled import TiledMLP, sequence_tiled_compute

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
