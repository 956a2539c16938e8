"""Group accessors with DeepSpeed's names (``deepspeed.utils.groups``), read from the current mesh.

Which mesh (:func:`current_mesh`):

1. inside an engine's ``forward`` / ``backward`` / ``step`` (and model code they call), or under
   ``with dscore.runtime.context.use_runtime(engine.runtime):``, that engine's mesh;
2. elsewhere (after ``dscore.initialize``: Accelerate's Ulysses data-loader adapter, the Trainer's
   sequence-parallel loss, DeepSpeed's ALST tutorial), the mesh of the live engines ``initialize`` built in
   this process, the most recent one's; live engines whose meshes differ in shape make the accessors raise,
   naming both (wrap the call in ``use_runtime`` to choose);
3. with no live engine, the most recent mesh ``UlyssesSPAttentionHF.register_with_transformers`` built
   since the last ``initialize`` (the ``mpu`` Accelerate then passes to ``initialize``), while it is alive.

Steps 2 and 3 are the process policy ``process_mesh`` (:mod:`dscore.process`), which keeps weak
references only: a closed or collected engine no longer counts. With it off, only step 1 applies. Two
engines keep two meshes; nothing here creates groups.

DeepSpeed's private spellings (``_get_sequence_parallel_group`` ...) are aliases of the public ones. The
expert accessors take DeepSpeed's group name ``"ep_size_<E>"`` and read the groups the mesh built for
the MoE layers (:meth:`dscore.parallel.mesh.ParallelMesh.expert_groups`); they never create groups.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any

from dscore import process
from dscore.errors import DscoreError

if TYPE_CHECKING:
    from dscore.parallel.mesh import ParallelMesh

__all__ = [
    "current_mesh",
    "get_model_parallel_group",
    "get_model_parallel_rank",
    "get_model_parallel_world_size",
    "get_tensor_model_parallel_src_rank",
    "note_engine",
    "note_mesh",
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


# the "process_mesh" policy's state: weak references, most recent last (see the module docstring)
_LOCK = threading.Lock()
_ENGINES: list[tuple[int, weakref.ref[Any]]] = []
_MESHES: list[weakref.ref[Any]] = []
_COUNTER = [0]


def _record(target: list[Any], item: Any) -> None:
    with _LOCK:
        target.append(item)


def note_engine(engine: Any) -> None:
    """Make ``engine``'s mesh (``engine.runtime.mesh``) the process's mesh outside engine calls while the engine
    is live (not closed, not collected); ``dscore.initialize`` calls it. Policy ``process_mesh``: off, nothing
    is recorded."""
    with _LOCK:
        _COUNTER[0] += 1
        number = _COUNTER[0]
    process.apply("process_mesh", _record, _ENGINES, (number, weakref.ref(engine)))
    with _LOCK:
        _MESHES.clear()  # a mesh noted before this engine was its mpu, or is superseded by it


def note_mesh(mesh: ParallelMesh) -> None:
    """Make ``mesh`` (built before ``dscore.initialize``, e.g. by ``register_with_transformers``) the process's
    mesh while no engine is live, it is alive, and no engine was built since. Policy ``process_mesh``: off, nothing is recorded."""
    process.apply("process_mesh", _record, _MESHES, weakref.ref(mesh))


def _describe(number: int, engine: Any, mesh: ParallelMesh) -> str:
    s = mesh.shape
    return f"engine #{number} ({type(engine).__name__}: dp {s.dp} x sp {s.sp} x tp {s.tp})"


def _process_mesh() -> ParallelMesh | None:
    """Step 2 / 3 of the module docstring: the live engines' mesh, else the most recent live noted mesh."""
    with _LOCK:
        live: list[tuple[int, Any, Any]] = []
        for number, ref in list(_ENGINES):
            engine = ref()
            mesh = getattr(getattr(engine, "runtime", None), "mesh", None)
            if engine is None or getattr(engine, "closed", False) or mesh is None:
                _ENGINES.remove((number, ref))
                continue
            live.append((number, engine, mesh))
        _MESHES[:] = [r for r in _MESHES if r() is not None]
        pending = _MESHES[-1]() if _MESHES else None
    if not live:
        return pending
    number, engine, mesh = live[-1]
    for other_number, other, other_mesh in live[:-1]:
        if other_mesh is not mesh and other_mesh.shape != mesh.shape:
            raise DscoreError(
                f"two live engines have different parallel meshes: {_describe(other_number, other, other_mesh)} and "
                f"{_describe(number, engine, mesh)}; outside an engine call the group accessors cannot tell which "
                "you mean: close the one you are done with (engine.close()), or wrap the call in "
                "`with dscore.runtime.context.use_runtime(engine.runtime):`"
            )
    return mesh


def current_mesh() -> ParallelMesh:
    """The mesh the accessors read (see the module docstring for which).

    Raises:
        DscoreError: no runtime with a mesh is current and no engine or noted mesh is live; or two live engines
            have meshes of different shapes (names both).
    """
    from dscore.runtime.context import peek_runtime

    runtime = peek_runtime()
    mesh = getattr(runtime, "mesh", None)
    if mesh is None:
        mesh = _process_mesh()
    if mesh is None:
        raise DscoreError(
            "no parallel mesh is current: no live engine was built by dscore.initialize in this process (or the "
            "process policy process_mesh is off, see DSCORE_PROCESS_POLICIES); call this inside "
            "engine.forward/backward/step, or wrap it in `with dscore.runtime.context.use_runtime(engine.runtime):`, "
            "or read engine.runtime.mesh"
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


def get_model_parallel_group() -> Any:
    """The tensor-parallel process group (DeepSpeed's model-parallel group; DscoreError at degree 1)."""
    return current_mesh().get_tensor_model_parallel_group()


def get_model_parallel_world_size() -> int:
    """The tensor-parallel degree (DeepSpeed's model-parallel size; 1 under Ulysses alone, as DeepSpeed)."""
    return current_mesh().get_model_parallel_world_size()


def get_model_parallel_rank() -> int:
    """This rank's index in its tensor-parallel group."""
    return current_mesh().get_model_parallel_rank()


def get_tensor_model_parallel_src_rank() -> int:
    """The global rank of tensor-parallel rank 0 in this rank's tensor-parallel group."""
    mesh = current_mesh()
    return mesh.shape.tp_ranks(mesh.rank)[0]


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
_get_model_parallel_world_size = get_model_parallel_world_size
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
