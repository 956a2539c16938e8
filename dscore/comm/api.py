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
    "all_gather_into_tensor",
    "all_reduce",
    "barrier",
    "broadcast",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "is_initialized",
    "new_group",
    "reduce_scatter",
    "reduce_scatter_tensor",
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


def barrier(group: Any = None) -> None:
    """:meth:`Comm.barrier` on :func:`active_comm`."""
    active_comm().barrier(group=group)


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
