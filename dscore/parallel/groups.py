"""Group accessors with DeepSpeed's names (``deepspeed.utils.groups``), read from the current mesh.

The mesh is the one ``dscore.initialize`` built for the engine whose runtime is current: inside the
engine's ``forward`` / ``backward`` / ``step`` (and model code they call) it is set; elsewhere wrap the
call in ``with dscore.runtime.context.use_runtime(engine.runtime):`` or use ``engine.runtime.mesh``
directly. No module-level group state exists: two engines keep two meshes.

DeepSpeed's private spellings (``_get_sequence_parallel_group`` ...) are aliases of the public ones. The
expert accessors take DeepSpeed's group name ``"ep_size_<E>"`` and read the groups the mesh built for
the MoE layers (:meth:`dscore.parallel.mesh.ParallelMesh.expert_groups`); they never create groups.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dscore.errors import DscoreError

if TYPE_CHECKING:
    from dscore.parallel.mesh import ParallelMesh

__all__ = [
    "current_mesh",
    "get_data_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_world_size",
    "get_expert_data_parallel_group",
    "get_expert_data_parallel_rank",
    "get_expert_data_parallel_world_size",
    "get_expert_parallel_group",
    "get_expert_parallel_rank",
    "get_expert_parallel_world_size",
    "get_sequence_data_parallel_group",
    "get_sequence_data_parallel_rank",
    "get_sequence_data_parallel_world_size",
    "get_sequence_parallel_group",
    "get_sequence_parallel_rank",
    "get_sequence_parallel_world_size",
    "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_zero_param_intra_parallel_group",
    "get_zero_param_intra_parallel_group_ranks",
    "get_zero_param_intra_parallel_group_world_size",
    "get_zero_param_intra_parallel_rank_in_mygroup",
]


def current_mesh() -> ParallelMesh:
    """The current runtime's mesh.

    Raises:
        DscoreError: no runtime is current, or it has no mesh (built outside ``dscore.initialize``).
    """
    from dscore.runtime.context import peek_runtime

    runtime = peek_runtime()
    mesh = getattr(runtime, "mesh", None)
    if mesh is None:
        raise DscoreError(
            "no parallel mesh is current: call this inside engine.forward/backward/step, or wrap it in "
            "`with dscore.runtime.context.use_runtime(engine.runtime):`, or read engine.runtime.mesh"
        )
    return mesh


def get_tensor_model_parallel_group() -> Any:
    """The tensor-parallel process group (``group.WORLD`` when it spans the job; DscoreError at degree 1)."""
    return current_mesh().get_tensor_model_parallel_group()


def get_tensor_model_parallel_world_size() -> int:
    """The tensor-parallel degree."""
    return current_mesh().tp_size


def get_tensor_model_parallel_rank() -> int:
    """This rank's index in its tensor-parallel group."""
    return current_mesh().tp_rank


def get_sequence_parallel_group() -> Any:
    """The sequence-parallel process group (``group.WORLD`` when it spans the job; DscoreError at degree 1)."""
    return current_mesh().get_sequence_parallel_group()


def get_sequence_parallel_world_size() -> int:
    """The sequence-parallel degree."""
    return current_mesh().sp_size


def get_sequence_parallel_rank() -> int:
    """This rank's index in its sequence-parallel group."""
    return current_mesh().sp_rank


def get_data_parallel_group() -> Any:
    """The data-parallel process group (``group.WORLD`` when it spans the job)."""
    return current_mesh().get_data_parallel_group()


def get_data_parallel_world_size() -> int:
    """The data-parallel degree ``world / (tp x sp)``."""
    return current_mesh().dp_size


def get_data_parallel_rank() -> int:
    """This rank's index along the data dimension."""
    return current_mesh().dp_rank


def get_sequence_data_parallel_group() -> Any:
    """The group gradients are reduced over (sequence x data ranks)."""
    return current_mesh().get_sequence_data_parallel_group()


def get_sequence_data_parallel_world_size() -> int:
    """``sp x dp``."""
    return current_mesh().get_sequence_data_parallel_world_size()


def get_sequence_data_parallel_rank() -> int:
    """This rank's index in the sequence x data group."""
    return current_mesh().get_sequence_data_parallel_rank()


def get_zero_param_intra_parallel_group() -> Any:
    """The ZeRO++ hpZ group (``zero_hpz_partition_size``) of this rank, or None when hpZ is off (as
    DeepSpeed's ``_get_zero_param_intra_parallel_group``); ``group.WORLD`` when it spans the job."""
    comm = current_mesh().zero_param_intra_comm
    if comm is None:
        return None
    if comm.group is None:
        import torch.distributed as dist

        return dist.group.WORLD
    return comm.group


def get_zero_param_intra_parallel_group_world_size() -> int:
    """Ranks in this rank's hpZ group (1 when hpZ is off)."""
    comm = current_mesh().zero_param_intra_comm
    return 1 if comm is None else int(comm.world_size)


def get_zero_param_intra_parallel_rank_in_mygroup() -> int:
    """This rank's index in its hpZ group (0 when hpZ is off)."""
    comm = current_mesh().zero_param_intra_comm
    return 0 if comm is None else int(comm.rank)


def get_zero_param_intra_parallel_group_ranks() -> list[int]:
    """Global ranks of this rank's hpZ group (just this rank when hpZ is off)."""
    mesh = current_mesh()
    size = get_zero_param_intra_parallel_group_world_size()
    return mesh.shape.zero_param_ranks(mesh.rank, size)
def get_expert_parallel_group(group_name: str) -> Any:
    """The expert-parallel process group ``group_name`` (``"ep_size_<E>"``; ``group.WORLD`` when it spans
    the job). Raises DscoreError when the mesh has no such groups."""
    mesh = current_mesh()
    return mesh._group_of(mesh.created_expert_groups(group_name).ep_comm, "expert-parallel", group_name)


def get_expert_parallel_world_size(group_name: str) -> int:
    """The expert-parallel size ``E`` of ``group_name``."""
    return int(current_mesh().created_expert_groups(group_name).topology.ep_size)


def get_expert_parallel_rank(group_name: str) -> int:
    """This rank's index in its expert-parallel group (which experts it holds)."""
    return int(current_mesh().created_expert_groups(group_name).ep_rank)


def get_expert_data_parallel_group(group_name: str) -> Any:
    """The expert-data-parallel process group of ``group_name`` (the ranks holding the same experts)."""
    mesh = current_mesh()
    return mesh._group_of(mesh.created_expert_groups(group_name).edp_comm, "expert-data-parallel", group_name)


def get_expert_data_parallel_world_size(group_name: str) -> int:
    """The expert-data-parallel size ``dp / E``."""
    groups = current_mesh().created_expert_groups(group_name)
    return groups.topology.world_size // groups.topology.ep_size


def get_expert_data_parallel_rank(group_name: str) -> int:
    """This rank's index in its expert-data-parallel group."""
    return int(current_mesh().created_expert_groups(group_name).edp_rank)


# DeepSpeed's spellings (deepspeed.utils.groups)
_get_sequence_parallel_group = get_sequence_parallel_group
_get_sequence_parallel_world_size = get_sequence_parallel_world_size
_get_sequence_parallel_rank = get_sequence_parallel_rank
_get_data_parallel_group = get_data_parallel_group
_get_data_parallel_world_size = get_data_parallel_world_size
_get_data_parallel_rank = get_data_parallel_rank
_get_sequence_data_parallel_group = get_sequence_data_parallel_group
_get_sequence_data_parallel_world_size = get_sequence_data_parallel_world_size
_get_sequence_data_parallel_rank = get_sequence_data_parallel_rank
_get_zero_param_intra_parallel_group = get_zero_param_intra_parallel_group
_get_zero_param_intra_parallel_group_world_size = get_zero_param_intra_parallel_group_world_size
_get_zero_param_intra_parallel_rank_in_mygroup = get_zero_param_intra_parallel_rank_in_mygroup
_get_zero_param_intra_parallel_group_ranks = get_zero_param_intra_parallel_group_ranks
_get_expert_parallel_group = get_expert_parallel_group
_get_expert_parallel_world_size = get_expert_parallel_world_size
_get_expert_parallel_rank = get_expert_parallel_rank
_get_expert_data_parallel_group = get_expert_data_parallel_group
_get_expert_data_parallel_world_size = get_expert_data_parallel_world_size
_get_expert_data_parallel_rank = get_expert_data_parallel_rank
