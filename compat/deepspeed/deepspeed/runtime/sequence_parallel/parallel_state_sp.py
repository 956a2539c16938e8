"""``deepspeed.runtime.sequence_parallel.parallel_state_sp``: DeepSpeed 0.19.8's module-level sequence-parallel
state, on :class:`dscore.parallel.ParallelMesh`.

``initialize_sequence_parallel(sequence_parallel_size)`` builds a dscore mesh over the world with that many
sequence-parallel ranks (collective: every rank calls it; ranks ``[k*sp, (k+1)*sp)`` form a sequence group,
as DeepSpeed lays them out); the accessors read it. DeepSpeed's ``get_model_parallel_*`` aliases name the
sequence-parallel group (what ``deepspeed.initialize(mpu=...)`` reads in DeepSpeed).
"""

from __future__ import annotations

from typing import Any

from dscore.comm import Comm
from dscore.errors import DistributedError
from dscore.parallel import ParallelMesh

__all__ = [
    "get_model_parallel_group",
    "get_model_parallel_rank",
    "get_model_parallel_world_size",
    "get_sequence_data_parallel_group",
    "get_sequence_data_parallel_rank",
    "get_sequence_data_parallel_world_size",
    "get_sequence_parallel_group",
    "get_sequence_parallel_rank",
    "get_sequence_parallel_world_size",
    "initialize_sequence_parallel",
]

_MESH: ParallelMesh | None = None


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    """Build the sequence-parallel and sequence-data-parallel groups (collective over the world).

    Args:
        sequence_parallel_size: ranks per sequence-parallel group; divides the world size.

    Raises:
        DistributedError: ``torch.distributed`` is not initialized.
        ConfigError: ``sequence_parallel_size`` does not divide the world size.
    """
    import torch.distributed as dist

    global _MESH
    if not (dist.is_available() and dist.is_initialized()):
        raise DistributedError("parallel_state_sp.initialize_sequence_parallel() needs torch.distributed initialized "
                               "first (deepspeed.init_distributed())")
    _MESH = ParallelMesh.create(Comm(None), sp=int(sequence_parallel_size))


def _mesh(accessor: str) -> ParallelMesh:
    if _MESH is None:
        raise DistributedError(f"parallel_state_sp.{accessor}() before initialize_sequence_parallel(size): call it "
                               "first (on every rank)")
    return _MESH


def get_sequence_parallel_group() -> Any:
    """This rank's sequence-parallel ``torch.distributed`` group."""
    return _mesh("get_sequence_parallel_group").get_sequence_parallel_group()


def get_sequence_parallel_world_size() -> int:
    """Ranks in this rank's sequence-parallel group."""
    return _mesh("get_sequence_parallel_world_size").get_sequence_parallel_world_size()


def get_sequence_parallel_rank() -> int:
    """This rank's index in its sequence-parallel group."""
    return _mesh("get_sequence_parallel_rank").get_sequence_parallel_rank()


def get_sequence_data_parallel_group() -> Any:
    """The group over which gradients are reduced (sequence x data parallel: the world here)."""
    return _mesh("get_sequence_data_parallel_group").get_sequence_data_parallel_group()


def get_sequence_data_parallel_world_size() -> int:
    """Ranks in the sequence-data-parallel group."""
    return _mesh("get_sequence_data_parallel_world_size").get_sequence_data_parallel_world_size()


def get_sequence_data_parallel_rank() -> int:
    """This rank's index in the sequence-data-parallel group."""
    return _mesh("get_sequence_data_parallel_rank").get_sequence_data_parallel_rank()


# DeepSpeed's aliases: its engine reads the sequence group through the mpu's model-parallel accessors
get_model_parallel_group = get_sequence_parallel_group
get_model_parallel_world_size = get_sequence_parallel_world_size
get_model_parallel_rank = get_sequence_parallel_rank
