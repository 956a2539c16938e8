"""The backend's own collectives (``torch.distributed``: NCCL, gloo, any registered backend), with exact
emulations of what a backend lacks.

The default transport, and the only one a device tensor ever takes (NCCL's rule: collectives get device
tensors; host shared memory or gloo point-to-point never stands in for device memory). Older gloo builds
have no ``ReduceOp.AVG`` and no reduce-scatter: ``avg`` becomes a sum followed by a division by the group
size (what NCCL's average computes, for floating tensors), and a reduce-scatter becomes an all-reduce of
the whole input followed by a copy of this rank's slice (exact for every op; it moves ``world_size``
times more data). The native call is tried first and, when the backend raises that it does not support
it, the emulation is used from then on (per :class:`NativeTransport`, i.e. per ``Comm``); ``emulated``
forces it (tests check both paths).

Besides the operations of :class:`~dscore.comm.transports.Transport` (on any layout, not only flat
CPU tensors) it runs the collectives only a backend has here: single-buffer reduce-scatter and
all-gather, broadcast and all-to-all.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from dscore.comm.work import Work

__all__ = ["NativeTransport", "result"]

log = logging.getLogger("dscore.comm")

_UNSUPPORTED_MARKERS = ("not supported", "unsupported", "does not support", "not implemented")


def _is_avg(op: Any) -> bool:
    return op == dist.ReduceOp.AVG


def result(work: Any, async_op: bool, finish: Callable[[], Any] | None = None) -> Work | None:
    """A backend call's outcome as the facade returns it: a :class:`Work` (``async_op``; ``finish`` runs
    once it completed) or None after running ``finish`` (blocking: the call already completed)."""
    if async_op:
        if isinstance(work, Work) and finish is None:
            return work
        return Work([work] if not isinstance(work, list) else work, finish)
    if finish is not None:
        finish()
    return None


class NativeTransport:
    """The backend's collectives for one :class:`~dscore.comm.Comm` (see the module docstring).

    Args:
        backend: the comm-backend plugin name, for the log line when an emulation takes over.
        emulated: operations (``"avg"``, ``"reduce_scatter_tensor"``, ``"reduce_scatter"``,
            ``"all_gather_into_tensor"``) to emulate from the start; the set grows when a backend refuses one.
    """

    name = "native"

    def __init__(self, backend: str = "", emulated: Iterable[str] = ()) -> None:
        self.backend = backend
        self.emulated: set[str] = set(emulated)

    def copy(self) -> NativeTransport:
        """A transport with the same backend name and (a copy of the) emulated operations."""
        return NativeTransport(self.backend, self.emulated)

    def _native_or_emulated(self, key: str, native: Callable[[], Any], emulated: Callable[[], Any]) -> Any:
        if key in self.emulated:
            return emulated()
        try:
            return native()
        except (RuntimeError, ValueError, NotImplementedError) as exc:
            text = str(exc).lower()
            if not any(marker in text for marker in _UNSUPPORTED_MARKERS):
                raise
            log.info("backend %s lacks %s (%s); using the exact emulation from now on", self.backend, key, exc)
            self.emulated.add(key)
            return emulated()

    # ------------------------------------------------------------------ the Transport operations
    def accepts(self, op: str, group: Any, tensors: Sequence[torch.Tensor]) -> bool:
        """True: the backend runs every collective (the facade's fallback)."""
        return True

    def flush(self, timeout: float) -> int:
        """0: nothing to deliver (a backend's own works hold their buffers until they complete)."""
        return 0

    def all_reduce(self, flat: torch.Tensor, rop: Any, grp: Any, async_op: bool) -> Work | None:
        """``dist.all_reduce`` of ``flat`` (any shape) in place; an average the backend lacks is a sum
        divided by the group size (floating tensors: the caller checks)."""
        if not _is_avg(rop):
            return result(dist.all_reduce(flat, op=rop, group=grp, async_op=async_op), async_op)

        def emulated() -> Any:
            work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=grp, async_op=async_op)
            return result(work, async_op, lambda: flat.div_(dist.get_world_size(grp)))

        return self._native_or_emulated(
            "avg",
            lambda: result(dist.all_reduce(flat, op=rop, group=grp, async_op=async_op), async_op),
            emulated,
        )

    def reduce_scatter(self, chunks: list[torch.Tensor], output: torch.Tensor, rop: Any, grp: Any,
                       async_op: bool) -> Work | None:
        """``dist.reduce_scatter(output, chunks)`` (``chunks[r]`` of every rank reduced into rank ``r``'s
        ``output``); emulated as an all-reduce of the concatenated chunks and a slice copy where the
        backend lacks it or its average."""

        def native() -> Any:
            work = dist.reduce_scatter(output, list(chunks), op=rop, group=grp, async_op=async_op)
            return result(work, async_op)

        def emulated() -> Any:
            full = torch.cat([t.detach().reshape(-1) for t in chunks])
            return self.emulated_slice(full, output, rop, grp, async_op)

        if _is_avg(rop) and "avg" in self.emulated:
            return emulated()
        return self._native_or_emulated("reduce_scatter", native, emulated)

    def all_gather(self, src: torch.Tensor, outs: Sequence[torch.Tensor], grp: Any, async_op: bool) -> Work | None:
        """``dist.all_gather(outs, src)``: ``outs[q]`` receives rank ``q``'s ``src``."""
        return result(dist.all_gather(list(outs), src, group=grp, async_op=async_op), async_op)

    # ------------------------------------------------------------------ the backend's own operations
    def emulated_slice(self, full: torch.Tensor, output: torch.Tensor, rop: Any, grp: Any, async_op: bool) -> Any:
        """Reduce-scatter as an all-reduce of the flat ``full`` (``world_size * output.numel()`` elements,
        reduced in place), then a copy of this rank's slice into ``output`` (divided by the group size
        for an average)."""
        world = dist.get_world_size(grp)
        rank = dist.get_rank(grp)
        n = output.numel()
        work = dist.all_reduce(full, op=dist.ReduceOp.SUM if _is_avg(rop) else rop, group=grp, async_op=async_op)

        def finish() -> None:
            piece = full[rank * n : (rank + 1) * n]
            if _is_avg(rop):
                output.copy_((piece / world).view_as(output))
            elif piece.data_ptr() != output.data_ptr():
                output.copy_(piece.view_as(output))

        return result(work, async_op, finish)

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002 - torch's name
                              rop: Any, grp: Any, async_op: bool, *, reusable: bool = False,
                              emulate: bool = False) -> Work | None:
        """The backend's single-buffer reduce-scatter (``reduce_scatter_tensor``; flat views: gloo checks dim
        0, the contract is numel), or its emulation (:meth:`emulated_slice`; ``emulate`` forces it, as for
        a reduce op the pairwise transports lack). ``reusable``: the emulation may all-reduce ``input`` in
        place (contiguous) instead of a copy. ``output`` may alias this rank's slice of ``input``."""

        def emulated() -> Any:
            full = input.view(-1) if reusable else input.detach().clone().reshape(-1)
            return self.emulated_slice(full, output, rop, grp, async_op)

        if emulate or (_is_avg(rop) and "avg" in self.emulated):
            return emulated()
        native_fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

        def native() -> Any:
            src = input.contiguous().view(-1)
            dst = output.view(-1)
            if dst.untyped_storage().data_ptr() != src.untyped_storage().data_ptr():
                return result(native_fn(dst, src, op=rop, group=grp, async_op=async_op), async_op)
            # an output inside the input: receive into a temporary (backends may not read and write one buffer)
            tmp = torch.empty_like(dst)
            work = native_fn(tmp, src, op=rop, group=grp, async_op=async_op)
            return result(work, async_op, lambda: dst.copy_(tmp))

        return self._native_or_emulated("reduce_scatter_tensor", native, emulated)

    def all_gather_into_tensor(self, flat_out: torch.Tensor, input: torch.Tensor,  # noqa: A002 - torch's name
                               grp: Any, async_op: bool) -> Work | None:
        """The backend's single-buffer all-gather into the flat contiguous ``flat_out`` (rank order), or
        ``dist.all_gather`` into its chunks where the backend lacks it. ``input`` may be this rank's chunk
        of ``flat_out`` (it is copied first: collectives may not read and write the same memory)."""
        n = input.numel()
        src = input.contiguous().view(-1)
        if src.data_ptr() == flat_out[dist.get_rank(grp) * n :].data_ptr():
            src = src.clone()
        native_fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

        def native() -> Any:
            return result(native_fn(flat_out, src, group=grp, async_op=async_op), async_op)

        def emulated() -> Any:
            views = [chunk.view_as(src) for chunk in flat_out.split(n)]
            return result(dist.all_gather(views, src, group=grp, async_op=async_op), async_op)

        return self._native_or_emulated("all_gather_into_tensor", native, emulated)

    def broadcast(self, tensor: torch.Tensor, src: int, grp: Any, async_op: bool) -> Work | None:
        """``dist.broadcast`` from global rank ``src``, in place."""
        return result(dist.broadcast(tensor, src=int(src), group=grp, async_op=async_op), async_op)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        tensor: torch.Tensor,
        grp: Any,
        async_op: bool,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
    ) -> Work | None:
        """``dist.all_to_all_single`` along dim 0, even (no split sizes) or uneven (``output`` contiguous; the
        caller checks shapes and split sizes)."""
        return result(
            dist.all_to_all_single(
                output, tensor.contiguous(), output_split_sizes=output_split_sizes,
                input_split_sizes=input_split_sizes, group=grp, async_op=async_op,
            ),
            async_op,
        )
