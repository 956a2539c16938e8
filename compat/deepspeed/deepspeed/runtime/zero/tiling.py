"""``deepspeed.runtime.zero.tiling``: ``TiledLinear`` / ``TiledLinearReturnBias``, not provided by dscore
(using them raises :class:`deepspeed._not_provided.NotProvidedError`); dscore's tiled compute is
``dscore.parallel.ulysses`` (``TiledMLP``, ``sequence_tiled_compute``)."""

from __future__ import annotations

from deepspeed._not_provided import not_provided

__all__ = ["TiledLinear", "TiledLinearReturnBias"]

_WHY = ("dscore does not split a linear layer into weight tiles; its tiled compute splits the sequence "
        "(dscore.parallel.ulysses TiledMLP, sequence_tiled_compute)")
TiledLinear = not_provided("deepspeed.runtime.zero.tiling.TiledLinear", _WHY)
TiledLinearReturnBias = not_provided("deepspeed.runtime.zero.tiling.TiledLinearReturnBias", _WHY)
