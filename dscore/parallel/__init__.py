"""Parallel dimensions over one device mesh: data, tensor (AutoTP) and sequence (Ulysses).

* :mod:`dscore.parallel.mesh`: :class:`ParallelMesh`, the rank layout and the process groups of every
  dimension, built once by ``dscore.initialize`` (:func:`dscore.runtime.assembly.build_mesh`).
* :mod:`dscore.parallel.groups`: DeepSpeed-named accessors (``get_sequence_parallel_group`` ...).
* :mod:`dscore.parallel.autotp`: AutoTP training (``tp_model_init``, column/row linears).
* :mod:`dscore.parallel.ulysses`: Ulysses sequence parallelism (``UlyssesSPAttentionHF``,
  ``UlyssesSPDataLoaderAdapter``, ``TiledMLP``, ``sequence_tiled_compute``).

This package is lazy: importing it imports no torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ParallelMesh", "tp_model_init"]


def __getattr__(name: str) -> Any:
    if name == "ParallelMesh":
        from dscore.parallel.mesh import ParallelMesh

        return ParallelMesh
    if name == "tp_model_init":
        from dscore.parallel.autotp import tp_model_init

        return tp_model_init
    raise AttributeError(f"module 'dscore.parallel' has no attribute {name!r}")
