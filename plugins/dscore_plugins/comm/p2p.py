"""The ``p2p`` comm transport: gloo point-to-point all-gathers and sum/average reduce-scatters as pairwise
exchanges (CPU tensors on a gloo group with ``DSCORE_GLOO_NATIVE`` unset; all-reduces stay gloo's own).

All-gather: every rank sends its chunk to each peer and receives each peer's chunk straight into the
output. Reduce-scatter: every rank sends chunk ``q`` of its input to rank ``q`` and adds the
``world_size - 1`` chunks it receives to its own, in rank order. Each rank sends and receives
``(world_size - 1) / world_size`` of the data, a ring's volume. Measured on loopback, 2 ranks: the
reduce-scatter takes 0.4-0.6x the time of gloo's all-reduce (4-16 MB) and 0.3-0.5x of gloo's
reduce-scatter; the all-gather 0.3-0.5x of gloo's all-gather (0.5-2 MB).

Every transfer is posted when the collective is launched; point-to-point transfers of one group are
matched in posting order per peer and tag, so collectives launched in the same order on every rank pair
up in any wait order. CPU tensors only (torch has no gloo point-to-point on devices).

**A work dropped without ``wait()``.** A gloo ``isend``/``irecv`` handle owns its transfer's buffer, and
gloo's pair only holds a weak pointer to it: destroying the handle before the transfer finished leaves the
pair with a queued send it can never write (its device thread retries it forever) or a payload it can
never read, and every later message on that pair, gloo's own collectives included, waits behind it
(issue 27: the ``DSCORE_SHM=0`` soak hung inside gloo's ring all-reduce). So the transfers of a dropped
:class:`~dscore.comm.work.Work` are kept, per group, until they complete: the next ``wait()`` of a later
collective of the same group waits for those launched before it first (that adds no wait: the later
collective completes only once every peer launched it, hence the earlier one too, whose transfers gloo
then finishes on its own), and :func:`flush_dropped` delivers the rest before the group is destroyed or
the process exits. A transfer's own memory is held until then.
"""

from __future__ import annotations

import atexit
import logging
import time
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dscore import process
from dscore.comm.work import DONE, Work
from dscore.protocols.transport import TransportContext

__all__ = ["GlooP2PTransport", "flush_dropped", "make_transport"]

log = logging.getLogger("dscore.comm")

# tags of the pairwise reduce-scatter and all-gather; keep their transfers apart from a caller's own
# send/recv on the same group (those default to tag 0)
_PAIRWISE_TAG = 0x5C
_ALLGATHER_TAG = 0x5D


def _peer(grp: Any, q: int) -> int:
    return q if grp is None else dist.get_global_rank(grp, q)


# per group (weakly: a destroyed group takes its transfers along): collectives launched by this transport,
# and the transfers of dropped works as (launch number, gloo works) in the order they were dropped
_launches: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_dropped: weakref.WeakKeyDictionary[Any, list[tuple[int, list[Any]]]] = weakref.WeakKeyDictionary()
_exit_hook = False


def _key(grp: Any) -> Any:
    return dist.group.WORLD if grp is None else grp


class _PairwiseWork(Work):
    """The :class:`Work` of one pairwise collective: its transfers outlive it when it is dropped unwaited,
    and waiting it first completes the dropped transfers of the group launched before it."""

    __slots__ = ("_group", "_seq")

    def __init__(self, works: list[Any], finish: Callable[[], Any] | None, group: Any, seq: int) -> None:
        self._group = group
        self._seq = seq
        super().__init__(works, finish)

    def wait(self, timeout: Any = None) -> bool:
        """Complete the group's dropped transfers launched before this collective, then this one
        (:meth:`Work.wait`; same errors)."""
        _complete_dropped(self._group, self._seq, timeout)
        return super().wait(timeout)

    def __del__(self) -> None:
        if self._works:  # transfers still pending: gloo must keep their buffers until they complete
            global _exit_hook
            try:
                _dropped.setdefault(self._group, []).append((self._seq, list(self._works)))
                if not _exit_hook:
                    process.apply("p2p_exit_flush", atexit.register, flush_dropped)
                    _exit_hook = True
            except Exception:  # noqa: BLE001 - never raise from a finaliser (interpreter shutdown)
                pass


def _complete_dropped(group: Any, before: int, timeout: Any) -> None:
    """Wait for the dropped transfers of ``group`` launched before collective number ``before``."""
    pending = _dropped.get(group)
    if not pending:
        return
    due = [entry for entry in pending if entry[0] < before]
    if not due:
        return
    _dropped[group] = [entry for entry in pending if entry[0] >= before]
    for i, (_, works) in enumerate(due):
        try:
            for w in works:
                if timeout is None:
                    w.wait()
                else:
                    w.wait(timeout)
        except BaseException:
            _dropped[group] = due[i + 1 :] + _dropped[group]  # the failed one is gone with its pair
            raise


def _launched(works: list[Any], async_op: bool, grp: Any, finish: Callable[[], Any] | None = None) -> Work | None:
    """The transfers of one collective, already posted: a :class:`_PairwiseWork` (async), or None once waited."""
    group = _key(grp)
    seq = _launches.get(group, 0) + 1
    _launches[group] = seq
    work = _PairwiseWork(works, finish, group, seq)
    if async_op:
        return work
    work.wait()
    return None


def flush_dropped(timeout: float = 60.0) -> int:
    """Wait (``timeout`` seconds in all) for the transfers of works dropped unwaited, on every group, so a
    rank that is done delivers what its peers still wait for; run before a process group is destroyed
    and at exit. Returns how many transfers were left (0 normally: a peer that never launched the
    collective, or is gone, leaves some)."""
    deadline = time.monotonic() + timeout
    left = 0
    for group in list(_dropped.keys()):
        entries = _dropped.pop(group, [])
        for n, (_, works) in enumerate(entries):
            for i, w in enumerate(works):
                remaining = deadline - time.monotonic()
                try:
                    if remaining <= 0:
                        raise TimeoutError("flush_dropped: out of time")
                    w.wait(timedelta(seconds=remaining))
                except (RuntimeError, TimeoutError) as exc:
                    left += len(works) - i + sum(len(ws) for _, ws in entries[n + 1 :])
                    log.warning("gloo point-to-point: %d transfer(s) of works dropped unwaited were not delivered: "
                                "%s", left, exc)
                    break
            else:
                continue
            break
    return left


class GlooP2PTransport:
    """The gloo point-to-point transport of one facade (its state, the dropped transfers, is per group).

    Args:
        pairwise: ``pairwise(group) -> bool``, the facade's test that its pairwise fast paths apply to a
            group (gloo backend, ``DSCORE_GLOO_NATIVE`` unset).
    """

    name = "p2p"

    def __init__(self, pairwise: Callable[[Any], bool]) -> None:
        self._pairwise = pairwise

    def accepts(self, op: str, group: Any, tensors: Sequence[torch.Tensor]) -> bool:
        """All-gathers and reduce-scatters on a pairwise group (a pairwise all-reduce would move twice a
        ring's data: all-reduces are left to gloo's own)."""
        return op != "all_reduce" and self._pairwise(group)

    def all_reduce(self, flat: torch.Tensor, rop: Any, grp: Any, async_op: bool) -> Work | None:
        """Never accepted (:meth:`accepts`): gloo's own all-reduce runs them.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError("the p2p transport leaves all-reduces to the backend (accepts() refuses them)")

    def flush(self, timeout: float) -> int:
        """:func:`flush_dropped` (every group of this process)."""
        return flush_dropped(timeout)

    def reduce_scatter(self, chunks: list[torch.Tensor], output: torch.Tensor, rop: Any, grp: Any,
                       async_op: bool) -> Work | None:
        """Each peer ``q`` gets ``chunks[q]`` by ``isend``; this rank's chunk from every peer arrives by
        ``irecv`` into one ``(world_size - 1) x n`` buffer; the finishing step adds them to this rank's
        own chunk in rank order (deterministic), then divides for an average."""
        world = dist.get_world_size(grp)
        rank = dist.get_rank(grp)
        n = output.numel()
        if n == 0:
            return DONE if async_op else None
        peers = [q for q in range(world) if q != rank]
        received = torch.empty((world - 1, n), dtype=output.dtype, device=output.device)
        works = []
        for i, q in enumerate(peers):
            works.append(dist.isend(chunks[q], dst=_peer(grp, q), group=grp, tag=_PAIRWISE_TAG))
            works.append(dist.irecv(received[i], src=_peer(grp, q), group=grp, tag=_PAIRWISE_TAG))

        def finish() -> None:
            flat_out = output.view(-1)
            torch.add(chunks[rank], received[0], out=flat_out)
            for i in range(1, world - 1):
                flat_out.add_(received[i])
            if rop == dist.ReduceOp.AVG:
                flat_out.div_(world)

        return _launched(works, async_op, grp, finish)

    def all_gather(self, src: torch.Tensor, outs: Sequence[torch.Tensor], grp: Any, async_op: bool) -> Work | None:
        """This rank's ``src`` goes to every peer by ``isend`` (read until the work completes); each peer's
        arrives by ``irecv`` straight into its output."""
        rank = dist.get_rank(grp)
        if outs[rank].data_ptr() != src.data_ptr():
            outs[rank].copy_(src.view_as(outs[rank]))
        works = []
        for q in range(len(outs)):
            if q != rank:
                works.append(dist.isend(src, dst=_peer(grp, q), group=grp, tag=_ALLGATHER_TAG))
                works.append(dist.irecv(outs[q], src=_peer(grp, q), group=grp, tag=_ALLGATHER_TAG))
        return _launched(works, async_op, grp)


def make_transport(ctx: TransportContext) -> GlooP2PTransport:
    """The ``p2p`` unit's factory (:class:`~dscore.specs.CommTransportSpec`)."""
    return GlooP2PTransport(ctx.pairwise)
