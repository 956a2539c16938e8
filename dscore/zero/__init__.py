"""ZeRO, public side: the user-facing helpers and the building blocks of a ZeRO stage plugin.

User-facing: ``dscore.zero.Init`` (modules born partitioned) and ``dscore.zero.GatheredParameters``.
For stage authors (built-in and third-party, see CONTRIBUTING.md "Write a ZeRO stage"):

* :mod:`dscore.zero.reducer`: :class:`GradientReducer` / :class:`ReduceBucket`, the bucketed,
  hook-driven, asynchronous gradient reducer every stage uses;
* :mod:`dscore.zero.layout`: the partition layout (:class:`Segment`, :class:`GroupLayout`) and
  world-size-independent optimizer state (:func:`optimizer_state_dict`, :func:`load_optimizer_state`);
* :mod:`dscore.zero.optimizer`: the optimizer over flat partitions (:func:`build_optimizer`) and the
  global-norm unscale/clip (:func:`unscale_clip`);
* :mod:`dscore.zero.partition`: :class:`FlatUnit`, the storage model of stage 3;
* :mod:`dscore.zero.released`: released parameters refuse torch calls on their absent values
  (:class:`ReleasedParameter`, :func:`name_parameters`);
* :mod:`dscore.zero.leaf`: ZeRO-3 leaf modules (``set_z3_leaf_modules``, ``unset_z3_leaf_modules``,
  ``get_z3_leaf_modules``, ``z3_leaf_module``, ``z3_leaf_parameter``: DeepSpeed's names and semantics).

``import dscore; dscore.zero.Init`` loads this package lazily (it imports torch).
"""

from __future__ import annotations

from dscore.zero.init import GatheredParameters, Init
from dscore.zero.layout import (
    GroupLayout,
    Segment,
    gather_by_name,
    load_optimizer_state,
    load_partitioned_state,
    optimizer_state_dict,
    partitioned_state_dict,
    scatter_by_name,
)
from dscore.zero.leaf import (
    get_z3_leaf_modules,
    set_z3_leaf_modules,
    unset_z3_leaf_modules,
    z3_leaf_module,
    z3_leaf_parameter,
)
from dscore.zero.optimizer import (
    build_optimizer,
    check_client_groups,
    optimizer_state_bytes,
    refuse_self_communicating,
    unique_trainable,
    unscale_clip,
    unscale_clip_for_step,
)
from dscore.zero.partition import FlatUnit, ZeroParamStatus, is_partitioned, unit_of
from dscore.zero.reducer import GradientReducer, ReduceBucket
from dscore.zero.released import ReleasedParameter, name_parameters

__all__ = [
    "FlatUnit",
    "GatheredParameters",
    "GradientReducer",
    "GroupLayout",
    "Init",
    "ReduceBucket",
    "ReleasedParameter",
    "Segment",
    "ZeroParamStatus",
    "build_optimizer",
    "check_client_groups",
    "gather_by_name",
    "get_z3_leaf_modules",
    "is_partitioned",
    "load_optimizer_state",
    "load_partitioned_state",
    "name_parameters",
    "optimizer_state_bytes",
    "optimizer_state_dict",
    "partitioned_state_dict",
    "refuse_self_communicating",
    "scatter_by_name",
    "set_z3_leaf_modules",
    "unique_trainable",
    "unit_of",
    "unscale_clip",
    "unscale_clip_for_step",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
    "z3_leaf_parameter",
]
