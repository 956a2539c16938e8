"""``deepspeed.comm`` on :mod:`dscore.comm`: DeepSpeed's module-level collectives, with its signatures, over
the current runtime's :class:`dscore.comm.Comm` (or torch.distributed's default group outside an engine).

Every reducing call takes DeepSpeed's :class:`ReduceOp`, torch's ``ReduceOp`` or dscore's names (``"sum"``).
Bad inputs raise dscore's errors (:class:`dscore.errors.DistributedError`) naming the argument.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dscore.comm import api as _api
from dscore.comm import (
    configure,
    get_comm_operation_count,
    get_local_rank,
    get_logged_comm_ops,
    get_rank,
    get_world_size,
    has_comm_data,
    init_distributed,
    is_initialized,
    log_summary,
    new_group,
    reset_log,
)
from dscore.errors import DistributedError

from .reduce_op import ReduceOp

__all__ = [
    "P2POp",
    "ReduceOp",
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "allgather_fn",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "configure",
    "destroy_process_group",
    "gather",
    "get_all_ranks_from_group",
    "get_backend",
    "get_comm_operation_count",
    "get_global_rank",
    "get_local_rank",
    "get_logged_comm_ops",
    "get_rank",
    "get_world_group",
    "get_world_size",
    "has_all_gather_into_tensor",
    "has_all_reduce_coalesced",
    "has_coalescing_manager",
    "has_comm_data",
    "has_reduce_scatter_tensor",
    "inference_all_reduce",
    "init_distributed",
    "irecv",
    "is_available",
    "is_initialized",
    "isend",
    "log_summary",
    "monitored_barrier",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_fn",
    "reduce_scatter_tensor",
    "reset_log",
    "scatter",
    "send",
]


def is_available() -> bool:
    """True: dscore's comm layer is importable (DeepSpeed's ``comm.is_available``)."""
    return True


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    """The global rank of ``group_rank`` in ``group`` (``torch.distributed.get_global_rank``)."""
    import torch.distributed as dist

    if group is None:
        return int(group_rank)
    return int(dist.get_global_rank(group, group_rank))


def destroy_process_group(group: Any = None) -> None:
    """Destroy ``group`` (the default group when None) if torch.distributed is initialized
    (``torch.distributed.destroy_process_group``; DeepSpeed's test harness calls it after each test)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group(group)


# ------------------------------------------------------------------------------------------ collectives
def all_reduce(tensor: Any, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
    """Reduce ``tensor`` in place across ``group`` (:meth:`dscore.comm.Comm.all_reduce`)."""
    return _api.all_reduce(tensor, op=op, group=group, async_op=async_op)


def inference_all_reduce(tensor: Any, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
    """:func:`all_reduce` for inference: on one rank returns ``tensor`` as it is (DeepSpeed's), else the
    all-reduce's result (None, or a work handle with ``async_op``)."""
    if get_world_size(group) <= 1:
        return tensor
    return _api.all_reduce(tensor, op=op, group=group, async_op=async_op)


def all_reduce_coalesced(tensors: Sequence[Any], op: Any = ReduceOp.SUM, group: Any = None,
                         async_op: bool = False) -> Any:
    """All-reduce every tensor of ``tensors`` in place (:meth:`dscore.comm.Comm.all_reduce_coalesced`)."""
    return _api.all_reduce_coalesced(tensors, op=op, group=group, async_op=async_op)


def reduce(tensor: Any, dst: int, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
    """Reduce ``tensor`` into global rank ``dst``'s (:meth:`dscore.comm.Comm.reduce`)."""
    return _api.reduce(tensor, dst, op=op, group=group, async_op=async_op)


def reduce_scatter(output: Any, input_list: Sequence[Any], op: Any = ReduceOp.SUM, group: Any = None,
                   async_op: bool = False) -> Any:
    """``output`` on rank ``r`` receives the reduction of every rank's ``input_list[r]``."""
    return _api.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)


def reduce_scatter_tensor(output_tensor: Any, tensor: Any, op: Any = ReduceOp.SUM, group: Any = None,
                          async_op: bool = False) -> Any:
    """Reduce ``tensor`` across ranks; rank ``r`` keeps its equal slice in ``output_tensor``."""
    return _api.reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def reduce_scatter_fn(output_tensor: Any, tensor: Any, op: Any = ReduceOp.SUM, group: Any = None,
                      async_op: bool = False) -> Any:
    """DeepSpeed's ``reduce_scatter_fn``: :func:`reduce_scatter_tensor` (dscore always has it)."""
    return reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def all_gather(tensor_list: list[Any], tensor: Any, group: Any = None, async_op: bool = False) -> Any:
    """``tensor_list[r]`` receives rank ``r``'s ``tensor``."""
    return _api.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_into_tensor(output_tensor: Any, tensor: Any, group: Any = None, async_op: bool = False) -> Any:
    """Concatenate every rank's ``tensor`` into ``output_tensor`` in rank order."""
    return _api.all_gather_into_tensor(output_tensor, tensor, group=group, async_op=async_op)


def allgather_fn(output_tensor: Any, input_tensor: Any, group: Any = None, async_op: bool = False) -> Any:
    """DeepSpeed's ``allgather_fn``: :func:`all_gather_into_tensor` (dscore always has it)."""
    return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def all_gather_coalesced(output_tensors: Sequence[Any], input_tensors: Sequence[Any], group: Any = None,
                         async_op: bool = False) -> Any:
    """:func:`all_gather_into_tensor` of each pair, launched together."""
    return _api.all_gather_coalesced(output_tensors, input_tensors, group=group, async_op=async_op)


def broadcast(tensor: Any, src: int, group: Any = None, async_op: bool = False) -> Any:
    """Copy global rank ``src``'s ``tensor`` into ``tensor`` on every rank."""
    return _api.broadcast(tensor, src, group=group, async_op=async_op)


def all_to_all_single(output: Any, tensor: Any, output_split_sizes: Sequence[int] | None = None,
                      input_split_sizes: Sequence[int] | None = None, group: Any = None,
                      async_op: bool = False) -> Any:
    """All-to-all along dim 0, even or uneven (:meth:`dscore.comm.Comm.all_to_all_single`)."""
    return _api.all_to_all_single(output, tensor, output_split_sizes, input_split_sizes, group, async_op)


def all_to_all(output_tensor_list: Sequence[Any], input_tensor_list: Sequence[Any], group: Any = None,
               async_op: bool = False) -> Any:
    """List all-to-all (:meth:`dscore.comm.Comm.all_to_all`)."""
    return _api.all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=async_op)


def gather(tensor: Any, gather_list: list[Any] | None = None, dst: int = 0, group: Any = None,
           async_op: bool = False) -> Any:
    """``gather_list[r]`` on global rank ``dst`` receives rank ``r``'s ``tensor``."""
    return _api.gather(tensor, gather_list, dst=dst, group=group, async_op=async_op)


def scatter(tensor: Any, scatter_list: list[Any] | None = None, src: int = 0, group: Any = None,
            async_op: bool = False) -> Any:
    """Rank ``r`` receives global rank ``src``'s ``scatter_list[r]`` into ``tensor``."""
    return _api.scatter(tensor, scatter_list, src=src, group=group, async_op=async_op)


def barrier(group: Any = None, async_op: bool = False, device_ids: Sequence[int] | None = None) -> Any:
    """Wait for every rank of ``group`` (a work handle with ``async_op``)."""
    return _api.barrier(group=group, async_op=async_op, device_ids=device_ids)


def monitored_barrier(group: Any = None, timeout: Any = None, wait_all_ranks: bool = False) -> None:
    """A barrier naming the ranks that missed ``timeout`` (gloo; torch's ``monitored_barrier``)."""
    _api.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


# ------------------------------------------------------------------------------------------ point-to-point
def send(tensor: Any, dst: int, group: Any = None, tag: int = 0) -> None:
    """Send ``tensor`` to global rank ``dst`` (blocking)."""
    _api.send(tensor, dst, group=group, tag=tag)


def recv(tensor: Any, src: int | None = None, group: Any = None, tag: int = 0) -> int:
    """Receive into ``tensor`` from global rank ``src`` (None: any); returns the sender's rank."""
    return _api.recv(tensor, src, group=group, tag=tag)


def isend(tensor: Any, dst: int, group: Any = None, tag: int = 0) -> Any:
    """Start sending ``tensor`` to global rank ``dst``; returns a work handle."""
    return _api.isend(tensor, dst, group=group, tag=tag)


def irecv(tensor: Any, src: int | None = None, group: Any = None, tag: int = 0) -> Any:
    """Start receiving into ``tensor`` from global rank ``src`` (None: any); returns a work handle."""
    return _api.irecv(tensor, src, group=group, tag=tag)


class P2POp:
    """One transfer of :func:`batch_isend_irecv`: ``op`` is :func:`isend` or :func:`irecv` (this module's,
    or torch.distributed's), ``peer`` a global rank.

    Raises:
        DistributedError: ``op`` is neither.
    """

    def __init__(self, op: Any, tensor: Any, peer: int, group: Any = None, tag: int = 0) -> None:
        import torch.distributed as dist

        if op is isend or op is dist.isend:
            self.op = "isend"
        elif op is irecv or op is dist.irecv:
            self.op = "irecv"
        else:
            raise DistributedError(f"P2POp: op must be deepspeed.comm.isend or deepspeed.comm.irecv, got {op!r}")
        self.tensor = tensor
        self.peer = peer
        self.group = group
        self.tag = tag


def batch_isend_irecv(p2p_op_list: Sequence[P2POp]) -> list[Any]:
    """Launch the :class:`P2POp` list as one batch; returns one work handle per entry."""
    return _api.batch_isend_irecv(p2p_op_list)


# ------------------------------------------------------------------------------------------ objects
def all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
    """Fill ``object_list`` (one slot per rank of ``group``) with every rank's picklable ``obj``.

    Raises:
        DistributedError: ``object_list`` does not have one slot per rank (before any exchange).
    """
    world = get_world_size(group)
    if len(object_list) != world:
        raise DistributedError(
            f"all_gather_object: object_list has {len(object_list)} slots; it needs one per rank ({world})"
        )
    object_list[:] = _api.all_gather_object(obj, group=group)


def broadcast_object_list(object_list: list[Any], src: int, group: Any = None, device: Any = None) -> None:
    """Replace ``object_list``'s entries on every rank by global rank ``src``'s (in place; ``device``: where
    the bytes travel, default the group's object device).

    Raises:
        DistributedError: this rank's ``object_list`` has another length than ``src``'s (after the exchange).
    """
    got = _api.broadcast_object(list(object_list), src, group=group, device=device)
    if len(got) != len(object_list):
        raise DistributedError(
            f"broadcast_object_list: rank {src} sent {len(got)} objects; this rank's object_list has "
            f"{len(object_list)} slots (give every rank a list of the same length)"
        )
    object_list[:] = got


# ------------------------------------------------------------------------------------------ queries
def _comm() -> Any:
    return _api.active_comm()  # raises dscore's error when no process group exists


def get_backend(group: Any = None) -> str:
    """The torch backend of ``group`` (``"gloo"``, ``"nccl"``, ...)."""
    return _api.get_backend(group)


def get_world_group() -> Any:
    """torch.distributed's world group (``torch.distributed.group.WORLD``)."""
    import torch.distributed as dist

    _comm()
    return dist.group.WORLD


def get_all_ranks_from_group(group: Any = None) -> list[int]:
    """The global ranks of ``group`` (None: the world) in group-rank order."""
    return _api.get_all_ranks_from_group(group)


def has_all_gather_into_tensor() -> bool:
    """True: dscore's facade always provides :func:`all_gather_into_tensor` (emulated where needed)."""
    _comm()
    return True


def has_reduce_scatter_tensor() -> bool:
    """True: dscore's facade always provides :func:`reduce_scatter_tensor` (emulated where needed)."""
    _comm()
    return True


def has_all_reduce_coalesced() -> bool:
    """True: dscore's facade provides :func:`all_reduce_coalesced` (one flat all-reduce per dtype)."""
    _comm()
    return True


def has_coalescing_manager() -> bool:
    """Whether this torch has ``torch.distributed.distributed_c10d._coalescing_manager`` (DeepSpeed's query)."""
    import torch.distributed as dist

    _comm()
    return hasattr(dist, "distributed_c10d") and hasattr(dist.distributed_c10d, "_coalescing_manager")


def __getattr__(name: str) -> Any:
    raise AttributeError(
        f"deepspeed.comm.{name} is not provided by dscore's compatibility layer; it offers {', '.join(__all__)}"
    )
