"""Module-level collectives for code written against ``deepspeed.comm``.

Each function uses the current runtime's :class:`~dscore.comm.facade.Comm`, or, outside
``dscore.initialize``, a facade over torch.distributed's default group (created by
:func:`dscore.init_distributed` or by the user). Re-exported by :mod:`dscore.comm`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from dscore.comm.facade import Comm
from dscore.errors import DistributedError

__all__ = [
    "active_comm",
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object",
    "gather",
    "get_all_ranks_from_group",
    "get_backend",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "irecv",
    "is_initialized",
    "isend",
    "monitored_barrier",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "send",
]


def active_comm() -> Comm:
    """The current runtime's facade, else one over the default process group.

    Raises:
        DistributedError: no runtime is active and no default process group exists.
    """
    from dscore.runtime.context import peek_runtime

    runtime = peek_runtime()
    if runtime is not None:
        return runtime.comm
    if dist.is_available() and dist.is_initialized():
        return Comm(None, backend=str(dist.get_backend()))
    raise DistributedError(
        "no process group: call dscore.init_distributed() (or dscore.initialize()) before using dscore.comm"
    )


def is_initialized() -> bool:
    """True when torch.distributed has a default process group."""
    return dist.is_available() and dist.is_initialized()


def all_reduce(tensor: torch.Tensor, op: str | Any = "sum", group: Any = None, async_op: bool = False) -> Any:
    """:meth:`Comm.all_reduce` on :func:`active_comm`."""
    return active_comm().all_reduce(tensor, op=op, group=group, async_op=async_op)


def reduce_scatter_tensor(
    output: torch.Tensor, input: torch.Tensor, op: str | Any = "sum", group: Any = None, async_op: bool = False  # noqa: A002
) -> Any:
    """:meth:`Comm.reduce_scatter_tensor` on :func:`active_comm`."""
    return active_comm().reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)


def reduce_scatter(
    output: torch.Tensor, input_list: Sequence[torch.Tensor], op: str | Any = "sum", group: Any = None,
    async_op: bool = False,
) -> Any:
    """:meth:`Comm.reduce_scatter` on :func:`active_comm`."""
    return active_comm().reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)


def all_gather_into_tensor(
    output: torch.Tensor, input: torch.Tensor, group: Any = None, async_op: bool = False  # noqa: A002
) -> Any:
    """:meth:`Comm.all_gather_into_tensor` on :func:`active_comm`."""
    return active_comm().all_gather_into_tensor(output, input, group=group, async_op=async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
    """:meth:`Comm.all_gather` on :func:`active_comm`."""
    return active_comm().all_gather(tensor_list, tensor, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any:
    """:meth:`Comm.broadcast` on :func:`active_comm`."""
    return active_comm().broadcast(tensor, src, group=group, async_op=async_op)


def barrier(group: Any = None, async_op: bool = False, device_ids: Sequence[int] | None = None) -> Any:
    """:meth:`Comm.barrier` on :func:`active_comm`."""
    return active_comm().barrier(group=group, async_op=async_op, device_ids=device_ids)


def monitored_barrier(group: Any = None, timeout: Any = None, wait_all_ranks: bool = False) -> None:
    """:meth:`Comm.monitored_barrier` on :func:`active_comm`."""
    active_comm().monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


def all_to_all_single(
    output: torch.Tensor,
    tensor: torch.Tensor,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    """:meth:`Comm.all_to_all_single` on :func:`active_comm` (even or uneven split along dim 0)."""
    return active_comm().all_to_all_single(output, tensor, output_split_sizes, input_split_sizes, group, async_op)


def all_to_all(
    output_tensor_list: Sequence[torch.Tensor], input_tensor_list: Sequence[torch.Tensor], group: Any = None,
    async_op: bool = False,
) -> Any:
    """:meth:`Comm.all_to_all` on :func:`active_comm`."""
    return active_comm().all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=async_op)


def reduce(tensor: torch.Tensor, dst: int, op: str | Any = "sum", group: Any = None, async_op: bool = False) -> Any:
    """:meth:`Comm.reduce` on :func:`active_comm`."""
    return active_comm().reduce(tensor, dst, op=op, group=group, async_op=async_op)


def gather(
    tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int = 0, group: Any = None,
    async_op: bool = False,
) -> Any:
    """:meth:`Comm.gather` on :func:`active_comm`."""
    return active_comm().gather(tensor, gather_list, dst=dst, group=group, async_op=async_op)


def scatter(
    tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int = 0, group: Any = None,
    async_op: bool = False,
) -> Any:
    """:meth:`Comm.scatter` on :func:`active_comm`."""
    return active_comm().scatter(tensor, scatter_list, src=src, group=group, async_op=async_op)


def all_reduce_coalesced(
    tensors: Sequence[torch.Tensor], op: str | Any = "sum", group: Any = None, async_op: bool = False
) -> Any:
    """:meth:`Comm.all_reduce_coalesced` on :func:`active_comm`."""
    return active_comm().all_reduce_coalesced(tensors, op=op, group=group, async_op=async_op)


def all_gather_coalesced(
    output_tensors: Sequence[torch.Tensor], input_tensors: Sequence[torch.Tensor], group: Any = None,
    async_op: bool = False,
) -> Any:
    """:meth:`Comm.all_gather_coalesced` on :func:`active_comm`."""
    return active_comm().all_gather_coalesced(output_tensors, input_tensors, group=group, async_op=async_op)


def send(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> None:
    """:meth:`Comm.send` on :func:`active_comm` (``dst`` a global rank)."""
    active_comm().send(tensor, dst, tag=tag, group=group)


def recv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0) -> int:
    """:meth:`Comm.recv` on :func:`active_comm`; returns the sender's global rank."""
    return active_comm().recv(tensor, src, tag=tag, group=group)


def isend(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> Any:
    """:meth:`Comm.isend` on :func:`active_comm`."""
    return active_comm().isend(tensor, dst, tag=tag, group=group)


def irecv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0) -> Any:
    """:meth:`Comm.irecv` on :func:`active_comm`."""
    return active_comm().irecv(tensor, src, tag=tag, group=group)


def batch_isend_irecv(p2p_ops: Sequence[Any]) -> list[Any]:
    """:meth:`Comm.batch_isend_irecv` on :func:`active_comm`."""
    return active_comm().batch_isend_irecv(p2p_ops)


def all_gather_object(obj: Any, group: Any = None, device: Any = None) -> list[Any]:
    """:meth:`Comm.all_gather_object` on :func:`active_comm`: every rank's ``obj`` in rank order."""
    return active_comm().all_gather_object(obj, group=group, device=device)


def broadcast_object(obj: Any, src: int = 0, group: Any = None, device: Any = None) -> Any:
    """:meth:`Comm.broadcast_object` on :func:`active_comm`: global rank ``src``'s ``obj`` on every rank."""
    return active_comm().broadcast_object(obj, src, group=group, device=device)


def get_backend(group: Any = None) -> str:
    """:meth:`Comm.get_backend` on :func:`active_comm` (``"gloo"``, ``"nccl"``, ...)."""
    return active_comm().get_backend(group)


def get_all_ranks_from_group(group: Any = None) -> list[int]:
    """The global ranks of ``group`` (None: the active facade's group) in group-rank order."""
    return active_comm().group_ranks(group)


def get_rank(group: Any = None) -> int:
    """:meth:`Comm.get_rank` on :func:`active_comm`."""
    return active_comm().get_rank(group)


def get_world_size(group: Any = None) -> int:
    """:meth:`Comm.get_world_size` on :func:`active_comm`."""
    return active_comm().get_world_size(group)


def get_local_rank() -> int:
    """:meth:`Comm.get_local_rank` on :func:`active_comm`."""
    return active_comm().get_local_rank()


def new_group(ranks: Sequence[int], **kwargs: Any) -> Any:
    """:meth:`Comm.new_group` on :func:`active_comm`."""
    return active_comm().new_group(ranks, **kwargs)
