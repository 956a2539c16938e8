"""The comm-transport contract: what a ``comm_transport`` unit's factory receives and returns.

A transport moves the data of one collective of :class:`dscore.comm.Comm`. The facade keeps the backend's
own collectives (the *native* transport, :attr:`Comm.native`) in the core: it is always the fallback, and
the only one a non-CPU tensor ever takes (host shared memory or gloo point-to-point must never stand in
for device memory). The registered transports (:class:`~dscore.specs.CommTransportSpec`: the comm
plugin's ``shm`` and ``p2p``, or a third party's) are asked per collective in descending ``priority``
(ties by name); the first whose :meth:`Transport.accepts` says yes runs it.

The facade asks a registered transport only for what its three operations compute: an ``all_reduce`` or a
``reduce_scatter`` with a sum or average (``ReduceOp.SUM`` / ``ReduceOp.AVG``) of contiguous, non-bool
tensors, and an ``all_gather`` of contiguous tensors, all on CPU. Everything else goes to the native
transport without asking.

Factory signature (the spec's ``factory`` import string)::

    def make_transport(ctx: TransportContext) -> Transport: ...

It is called once per :class:`~dscore.comm.Comm` (a facade bound to a sub-group builds its own), lazily,
at the facade's first collective that may leave the backend. This module imports neither torch nor any
plugin.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from dscore.comm.work import Work
    from dscore.registry import Registry
    from dscore.specs import CommTransportSpec

__all__ = ["TRANSPORT_OPS", "Transport", "TransportContext"]

#: the operations a registered transport is asked for (the ``op`` argument of :meth:`Transport.accepts`)
TRANSPORT_OPS: frozenset[str] = frozenset({"all_reduce", "reduce_scatter", "all_gather"})


@runtime_checkable
class Transport(Protocol):
    """A way to move a collective's data.

    Every operation launches ALL of its transfers before it returns (numbered in launch order, the same on
    every rank) and returns a :class:`~dscore.comm.Work` (``async_op``) or None once finished; waiting
    only completes, so any wait order (or a work never waited) leaves later collectives right.

    Shapes: ``flat``, ``src`` and each of ``outs``/``chunks`` are flat contiguous tensors of one dtype
    (CPU tensors for a registered transport; the native one takes any layout). ``rop`` is
    ``torch.distributed.ReduceOp.SUM`` or ``AVG`` for a registered transport. ``grp`` is the process group
    (None: the default group).
    """

    name: str

    def accepts(self, op: str, group: Any, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether this transport runs ``op`` (one of :data:`TRANSPORT_OPS`) on ``group`` for ``tensors``.

        Must answer alike on every rank of ``group`` for the same call (each rank picks on its own); it may
        run a collective on ``group`` (a set-up on first use) only under that condition."""

    def all_reduce(self, flat: torch.Tensor, rop: Any, grp: Any, async_op: bool) -> Work | None:
        """Sum (``rop`` SUM) or average (AVG) ``flat`` in place on every rank."""

    def reduce_scatter(self, chunks: list[torch.Tensor], output: torch.Tensor, rop: Any, grp: Any,
                       async_op: bool) -> Work | None:
        """``output`` on rank ``r`` = the sum (or average) of every rank's ``chunks[r]``; ``output`` may
        alias ``chunks[rank]``."""

    def all_gather(self, src: torch.Tensor, outs: Sequence[torch.Tensor], grp: Any, async_op: bool) -> Work | None:
        """``outs[q]`` receives rank ``q``'s ``src`` (``src`` may be ``outs[rank]``)."""

    def flush(self, timeout: float) -> int:
        """Deliver, within ``timeout`` seconds, the transfers peers may still wait for that this kind of
        transport launched anywhere in this process (process-wide: one instance's call covers all); run
        before a process group is destroyed and at exit. Returns how many were left undelivered."""


@dataclass(frozen=True, kw_only=True)
class TransportContext:
    """What a transport factory receives (one per :class:`~dscore.comm.Comm` and transport).

    Attributes:
        spec: the transport's own registration.
        registry: the registry the facade took its transports from (the current runtime's inside
            ``dscore.initialize``, so ``plugins.disable`` holds; else one over the installed plugins).
        backend: the facade's comm-backend name (``"gloo"``; informational).
        pairwise: ``pairwise(group) -> bool``: whether the facade's pairwise fast paths apply to ``group``
            (gloo backend, ``DSCORE_GLOO_NATIVE`` unset; decided once per group, then a lookup).
        native: the facade's native transport (the backend's own collectives and their exact emulations).
        delegate: ``delegate(op, group, tensors) -> Transport``: the transport that would run this call if
            this one did not exist (the next registered one below it that accepts, else ``native``), for a
            transport that wraps another.
    """

    spec: CommTransportSpec
    registry: Registry
    backend: str
    pairwise: Callable[[Any], bool]
    native: Transport
    delegate: Callable[[str, Any, Sequence[Any]], Transport]
