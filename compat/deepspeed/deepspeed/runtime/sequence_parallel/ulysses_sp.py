"""``deepspeed.runtime.sequence_parallel.ulysses_sp``: Ulysses / ALST names mapped onto
:mod:`dscore.parallel.ulysses`.

``UlyssesSPAttentionHF`` (with ``register_with_transformers``, whose returned ``mpu`` is a
:class:`dscore.parallel.ParallelMesh` that ``deepspeed.initialize(mpu=...)`` takes), ``UlyssesSPDataLoaderAdapter``,
``TiledMLP`` and ``sequence_tiled_compute`` are dscore's own. DeepSpeed 0.19.8's other public names in this
module (``SequenceTiledCompute``, ``TiledFusedLogitsLoss``, ``AutogradComputeMLP``) import, and raise
:class:`deepspeed._not_provided.NotProvidedError` naming them when used.
"""

from __future__ import annotations

from typing import Any

from deepspeed._not_provided import not_provided
from dscore.parallel.ulysses import (
    TiledMLP,
    UlyssesSPAttentionHF,
    UlyssesSPDataLoaderAdapter,
    sequence_tiled_compute,
)

__all__ = ["TiledMLP", "UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter", "sequence_tiled_compute"]

_NOT_PROVIDED = frozenset({"SequenceTiledCompute", "TiledFusedLogitsLoss", "AutogradComputeMLP"})


_NOT_PROVIDED_REASON = "dscore's tiled compute is TiledMLP.apply(...) and sequence_tiled_compute(...) (dscore.parallel.ulysses)"


def __getattr__(name: str) -> Any:
    # a stand-in, so the import works and the error comes on use
    if name in _NOT_PROVIDED:
        value = not_provided(f"deepspeed.runtime.sequence_parallel.ulysses_sp.{name}", _NOT_PROVIDED_REASON)
        globals()[name] = value
        return value
    raise AttributeError(
        f"deepspeed.runtime.sequence_parallel.ulysses_sp.{name} is not provided by dscore's compatibility layer"
    )
