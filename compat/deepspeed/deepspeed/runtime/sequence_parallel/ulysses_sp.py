"""``deepspeed.runtime.sequence_parallel.ulysses_sp``: Ulysses / ALST names mapped onto
:mod:`dscore.parallel.ulysses`.

``UlyssesSPAttentionHF`` (with ``register_with_transformers``, whose returned ``mpu`` is a
:class:`dscore.parallel.ParallelMesh` that ``deepspeed.initialize(mpu=...)`` takes), ``UlyssesSPDataLoaderAdapter``,
``TiledMLP`` and ``sequence_tiled_compute`` are dscore's own. DeepSpeed 0.19.8's other public names in this
module (``SequenceTiledCompute``, ``TiledFusedLogitsLoss``, ``AutogradComputeMLP``) raise
:class:`dscore.errors.DscoreError` naming them.
"""

from __future__ import annotations

from typing import Any

from dscore.errors import DscoreError
from dscore.parallel.ulysses import (
    TiledMLP,
    UlyssesSPAttentionHF,
    UlyssesSPDataLoaderAdapter,
    sequence_tiled_compute,
)

__all__ = ["TiledMLP", "UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter", "sequence_tiled_compute"]

_NOT_PROVIDED = frozenset({"SequenceTiledCompute", "TiledFusedLogitsLoss", "AutogradComputeMLP"})


def __getattr__(name: str) -> Any:
    if name in _NOT_PROVIDED:
        raise DscoreError(
            f"deepspeed.runtime.sequence_parallel.ulysses_sp.{name} (DeepSpeed 0.19.8) is not provided by dscore; "
            "dscore's tiled compute is TiledMLP.apply(...) and sequence_tiled_compute(...) "
            "(dscore.parallel.ulysses)"
        )
    raise AttributeError(
        f"deepspeed.runtime.sequence_parallel.ulysses_sp.{name} is not provided by dscore's compatibility layer"
    )
