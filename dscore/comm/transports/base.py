"""The interface of a pairwise transport and the rule that picks one for a call."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from dscore.comm.work import Work

__all__ = ["Transport", "pick"]


class Transport(Protocol):
    """A way to move a collective's data. Every operation launches ALL of its transfers before it returns
    (numbered in launch order, the same on every rank) and returns a :class:`~dscore.comm.work.Work`
    (``async_op``) or None once finished; waiting only completes.

    Shapes: ``flat``, ``src`` and each of ``outs``/``chunks`` are flat or contiguous CPU tensors of one dtype.
    """

    name: str

    def all_reduce(self, flat: torch.Tensor, rop: Any, grp: Any, async_op: bool) -> Any:
        """Sum (``rop`` SUM) or average (AVG) ``flat`` in place: a :class:`Work`, None (finished), or
        ``NotImplemented`` when this transport leaves all-reduces to the backend."""

    def reduce_scatter(self, chunks: list[torch.Tensor], output: torch.Tensor, rop: Any, grp: Any,
                       async_op: bool) -> Work | None:
        """``output`` on rank ``r`` = the sum (or average) of every rank's ``chunks[r]``; ``output`` may
        alias ``chunks[rank]``."""

    def all_gather(self, src: torch.Tensor, outs: Sequence[torch.Tensor], grp: Any, async_op: bool) -> Work | None:
        """``outs[q]`` receives rank ``q``'s ``src`` (``src`` may be ``outs[rank]``)."""


def pick(grp: Any, pairwise: bool, tensors: Sequence[torch.Tensor]) -> Transport | None:
    """The pairwise transport for a call, or None for the backend's own collective (native).

    ``pairwise``: the group is on gloo and ``DSCORE_GLOO_NATIVE`` is not set (:meth:`Comm.gloo_fast`).
    A non-CPU tensor always takes the native path: gloo has no point-to-point for device tensors and host
    shared memory must never stand in for device memory (NCCL's rule; issue 28, defect 4). Otherwise
    shared memory when the group's channel exists (collective on a group's first use), else gloo
    point-to-point.
    """
    if not pairwise or any(t.device.type != "cpu" for t in tensors):
        return None
    from dscore.comm.shm import channel_for
    from dscore.comm.transports.p2p import P2P
    from dscore.comm.transports.shm import ShmTransport

    channel = channel_for(grp, dist.get_world_size(grp), dist.get_rank(grp))
    return P2P if channel is None else ShmTransport(channel)
