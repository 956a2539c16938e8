"""``deepspeed.utils.groups``: DeepSpeed's group accessors, mapped onto :mod:`dscore.parallel.groups`.

The accessors read the mesh of the current dscore runtime (inside ``engine.forward`` / ``backward`` /
``step``, or under ``dscore.runtime.context.use_runtime(engine.runtime)``), elsewhere the mesh of the live
engines ``deepspeed.initialize`` built (two live engines with different meshes: an error naming both), else
the mesh ``register_with_transformers`` built; see :func:`dscore.parallel.groups.current_mesh`. DeepSpeed
0.19.8 itself answers ``_get_sequence_parallel_world_size() == 1`` (and raises ``KeyError`` for the group)
before ``initialize`` has seen the mpu, and ``_get_data_parallel_world_size() is None`` with a Ulysses mpu;
dscore gives the mesh's real values. DeepSpeed spells the sequence and sequence-data accessors
with a leading underscore (``_get_sequence_parallel_group``, what Accelerate and transformers call); dscore's
public spellings (``get_sequence_parallel_group``) are here too. The expert accessors
(``_get_expert_parallel_group(group_name)`` and the world size / rank of it and of the expert-data-parallel
group) read the groups the mesh built for the MoE layers; the ``_get_zero_param_intra_parallel_*`` readers
read the ZeRO++ hpZ groups stage 3 builds from ``zero_hpz_partition_size``. DeepSpeed 0.19.8 accessors dscore
does not provide (expert group dicts, rank lists and source ranks, creating the ZeRO++ parameter groups, the
setters and initializers of DeepSpeed's module-level group state) import, and raise
:class:`deepspeed._not_provided.NotProvidedError` (a :class:`dscore.errors.DscoreError`) naming the accessor when used.
"""

from __future__ import annotations

from typing import Any

from deepspeed._not_provided import not_provided
from dscore.parallel.groups import (
    get_data_parallel_group,
    get_data_parallel_rank,
    get_data_parallel_world_size,
    get_expert_data_parallel_group,
    get_expert_data_parallel_rank,
    get_expert_data_parallel_world_size,
    get_expert_parallel_group,
    get_expert_parallel_rank,
    get_expert_parallel_world_size,
    get_model_parallel_group,
    get_model_parallel_rank,
    get_model_parallel_world_size,
    get_sequence_data_parallel_group,
    get_sequence_data_parallel_rank,
    get_sequence_data_parallel_world_size,
    get_sequence_parallel_group,
    get_sequence_parallel_rank,
    get_sequence_parallel_world_size,
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_src_rank,
    get_tensor_model_parallel_world_size,
    get_zero_param_intra_parallel_group,
    get_zero_param_intra_parallel_group_ranks,
    get_zero_param_intra_parallel_group_world_size,
    get_zero_param_intra_parallel_rank_in_mygroup,
)

# DeepSpeed's underscored spellings (what Accelerate and transformers call)
_get_data_parallel_group = get_data_parallel_group
_get_data_parallel_rank = get_data_parallel_rank
_get_data_parallel_world_size = get_data_parallel_world_size
_get_model_parallel_world_size = get_model_parallel_world_size
_get_sequence_data_parallel_group = get_sequence_data_parallel_group
_get_sequence_data_parallel_rank = get_sequence_data_parallel_rank
_get_sequence_data_parallel_world_size = get_sequence_data_parallel_world_size
_get_sequence_parallel_group = get_sequence_parallel_group
_get_sequence_parallel_rank = get_sequence_parallel_rank
_get_sequence_parallel_world_size = get_sequence_parallel_world_size
_get_zero_param_intra_parallel_group = get_zero_param_intra_parallel_group
_get_zero_param_intra_parallel_group_ranks = get_zero_param_intra_parallel_group_ranks
_get_zero_param_intra_parallel_group_world_size = get_zero_param_intra_parallel_group_world_size
_get_zero_param_intra_parallel_rank_in_mygroup = get_zero_param_intra_parallel_rank_in_mygroup
_get_expert_parallel_group = get_expert_parallel_group
_get_expert_parallel_world_size = get_expert_parallel_world_size
_get_expert_parallel_rank = get_expert_parallel_rank
_get_expert_data_parallel_group = get_expert_data_parallel_group
_get_expert_data_parallel_world_size = get_expert_data_parallel_world_size
_get_expert_data_parallel_rank = get_expert_data_parallel_rank

__all__ = [
    "_get_expert_data_parallel_group",
    "_get_expert_data_parallel_rank",
    "_get_expert_data_parallel_world_size",
    "_get_expert_parallel_group",
    "_get_expert_parallel_rank",
    "_get_expert_parallel_world_size",
    "_get_data_parallel_group",
    "_get_data_parallel_rank",
    "_get_data_parallel_world_size",
    "_get_model_parallel_world_size",
    "_get_sequence_data_parallel_group",
    "_get_sequence_data_parallel_rank",
    "_get_sequence_data_parallel_world_size",
    "_get_sequence_parallel_group",
    "_get_sequence_parallel_rank",
    "_get_sequence_parallel_world_size",
    "_get_zero_param_intra_parallel_group",
    "_get_zero_param_intra_parallel_group_ranks",
    "_get_zero_param_intra_parallel_group_world_size",
    "_get_zero_param_intra_parallel_rank_in_mygroup",
    "get_data_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_world_size",
    "get_model_parallel_group",
    "get_model_parallel_rank",
    "get_model_parallel_world_size",
    "get_sequence_data_parallel_group",
    "get_sequence_data_parallel_rank",
    "get_sequence_data_parallel_world_size",
    "get_sequence_parallel_group",
    "get_sequence_parallel_rank",
    "get_sequence_parallel_world_size",
    "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_src_rank",
    "get_tensor_model_parallel_world_size",
    "get_zero_param_intra_parallel_group",
    "get_zero_param_intra_parallel_group_ranks",
    "get_zero_param_intra_parallel_group_world_size",
    "get_zero_param_intra_parallel_rank_in_mygroup",
]

# DeepSpeed 0.19.8's other names in deepspeed.utils.groups, which dscore does not provide
_NOT_PROVIDED = frozenset({
    "initialize", "set_tensor_model_parallel_world_size", "set_tensor_model_parallel_rank",
    "mesh_device", "_get_data_parallel_group_ranks", "_get_broadcast_src_rank",
    "_clone_world_group", "_get_local_all_to_all_group",
    "_create_model_parallel", "_create_expert_and_data_parallel", "_create_expert_data_and_model_parallel",
    "_get_expert_parallel_ranks", "_get_max_expert_size", "_get_max_expert_size_name",
    "_get_max_expert_parallel_group", "_get_expert_parallel_group_ranks",
    "_get_expert_parallel_group_dict", "_get_expert_data_parallel_group_ranks",
    "_get_expert_data_parallel_group_dict", "_get_expert_broadcast_src_rank",
    "_get_expert_parallel_src_rank", "_get_expert_model_parallel_world_size",
    "_create_zero_param_parallel_group", "_zero_param_parallel_is_initialized",
})


_NOT_PROVIDED_REASON = (
    "dscore has no module-level group state or expert group dicts / rank lists, and builds the ZeRO++ hpZ groups "
    f"itself; the groups it builds are read with {', '.join(n for n in __all__ if not n.startswith('_'))} "
    "(dscore.parallel.groups) or from engine.runtime.mesh"
)


def __getattr__(name: str) -> Any:
    # a stand-in, so `from deepspeed.utils.groups import <name>` imports and the error comes on use
    if name in _NOT_PROVIDED:
        value = not_provided(f"deepspeed.utils.groups.{name}", _NOT_PROVIDED_REASON)
        globals()[name] = value
        return value
    raise AttributeError(f"deepspeed.utils.groups.{name} is not provided by dscore's compatibility layer")
