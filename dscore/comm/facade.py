"""The collective facade: :class:`Comm`, a thin layer over ``torch.distributed`` bound to a process group.

A ``Comm`` is created by :func:`dscore.init_distributed` and owned by the runtime
(:class:`dscore.runtime.runtime.Runtime`); it is not a module global. Every collective takes the same
tensors and returns the same work handles as ``torch.distributed``, with three conveniences:

* ``op`` is a string (``"sum"``, ``"avg"``, ``"max"``, ``"min"``, ``"product"``) or a ``ReduceOp``;
* ``group=None`` means the group this facade is bound to (the default group after ``init_distributed``);
* operations a backend lacks are emulated exactly. Older gloo builds have no ``ReduceOp.AVG`` and no
  reduce-scatter: ``avg`` becomes a sum followed by a division by the group size (the same result
  NCCL's average computes, for floating tensors), and reduce-scatter becomes an all-reduce of the whole
  input followed by a copy of this rank's slice (exact for every op; it moves ``world_size`` times more
  data). A facade decides once per operation: the native call is tried first and, when the backend
  raises that it does not support it, the emulation is used from then on. ``emulate=`` forces the
  emulation (tests use it to check both paths).

Ranks passed to :meth:`Comm.broadcast` (``src``) are global ranks, as in torch.distributed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from dscore.errors import DistributedError

if TYPE_CHECKING:
    from dscore.comm.env import DistributedEnv

__all__ = ["Comm", "EMULABLE_OPS", "reduce_op"]

log = logging.getLogger("dscore.comm")

#: operations the facade can emulate when the backend lacks them.
EMULABLE_OPS = frozenset({"avg", "reduce_scatter_tensor", "reduce_scatter"})

_OPS: dict[str, Any] = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "mean": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
    "prod": dist.ReduceOp.PRODUCT,
}

_UNSUPPORTED_MARKERS = ("not supported", "unsupported", "does not support", "not implemented")


def reduce_op(op: str | Any) -> Any:
    """The ``torch.distributed.ReduceOp`` for ``op`` (a name, case-insensitive, or a ReduceOp).

    Raises:
        DistributedError: unknown name; the message lists the valid ones.
    """
    if not isinstance(op, str):
        return op
    try:
        return _OPS[op.lower()]
    except KeyError:
        raise DistributedError(f"unknown reduce op {op!r}; valid: {', '.join(sorted(_OPS))}") from None


def _require_contiguous(output: torch.Tensor, what: str) -> None:
    if not output.is_contiguous():
        raise DistributedError(f"{what}: the output tensor must be contiguous (call .contiguous() on a buffer first)")


def _is_avg(op: Any) -> bool:
    return op == dist.ReduceOp.AVG


class _PostProcessedWork:
    """A work handle whose ``wait()`` also runs the emulation's finishing step (division or slice copy)."""

    def __init__(self, work: Any, finish: Callable[[], None]) -> None:
        self._work = work
        self._finish = finish
        self._done = False

    def wait(self, timeout: Any = None) -> bool:
        """Wait for the collective, then finish the emulation once; returns True."""
        if timeout is None:
            self._work.wait()
        else:
            self._work.wait(timeout)
        if not self._done:
            self._finish()
            self._done = True
        return True

    def is_completed(self) -> bool:
        """True once :meth:`wait` finished (the emulation's last step runs inside ``wait``)."""
        return self._done

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class Comm:
    """Collectives over one process group (see the module docstring for emulation rules).

    Args:
        group: the process group collectives run on when ``group=None`` is passed (``None``: the default
            group).
        backend: the comm-backend plugin name (``"gloo"``) — informational.
        env: where this process sits (local rank, rendezvous); ``None`` reads ``LOCAL_RANK`` lazily.
        emulate: operations (of :data:`EMULABLE_OPS`) to emulate even if the backend has them.
        owns_group: True when the call that built this facade created the default group (so dscore
            owns it and may destroy it; see :mod:`dscore.comm.init`).

    Raises:
        DistributedError: ``emulate`` names an operation that cannot be emulated.
    """

    def __init__(
        self,
        group: Any = None,
        *,
        backend: str = "",
        env: DistributedEnv | None = None,
        emulate: Iterable[str] = (),
        owns_group: bool = False,
    ) -> None:
        forced = {name.lower() for name in emulate}
        unknown = forced - EMULABLE_OPS
        if unknown:
            raise DistributedError(f"cannot emulate {sorted(unknown)}; emulable operations: {sorted(EMULABLE_OPS)}")
        self.group = group
        self.backend = backend
        self.env = env
        self._emulated: set[str] = set(forced)
        self.owns_group = bool(owns_group)

    def __repr__(self) -> str:
        if not self.is_initialized():
            return f"Comm(backend={self.backend!r}, no process group)"
        return f"Comm(backend={self.backend!r}, rank={self.get_rank()}, world_size={self.get_world_size()})"

    # ---------------------------------------------------------------- identity
    def _group(self, group: Any) -> Any:
        return self.group if group is None else group

    @staticmethod
    def is_initialized() -> bool:
        """True when torch.distributed has a default process group."""
        return dist.is_available() and dist.is_initialized()

    def get_rank(self, group: Any = None) -> int:
        """This process's rank in ``group`` (the bound group by default)."""
        return int(dist.get_rank(self._group(group)))

    def get_world_size(self, group: Any = None) -> int:
        """Number of ranks in ``group`` (the bound group by default)."""
        return int(dist.get_world_size(self._group(group)))

    def get_local_rank(self) -> int:
        """Rank of this process among those of its node (``LOCAL_RANK``)."""
        if self.env is not None:
            return self.env.local_rank
        return int(os.environ.get("LOCAL_RANK", "0"))

    def get_backend(self, group: Any = None) -> str:
        """The torch backend string of ``group`` (``"gloo"``, ``"nccl"``, ...)."""
        return str(dist.get_backend(self._group(group)))

    def new_group(self, ranks: Sequence[int], **kwargs: Any) -> Any:
        """A new process group of the global ``ranks`` (every rank of the default group must call this).

        Extra keyword arguments go to ``torch.distributed.new_group`` (``timeout``, ``backend``).
        """
        return dist.new_group(ranks=sorted(int(r) for r in ranks), **kwargs)

    def bound_to(self, group: Any) -> Comm:
        """A facade sharing this one's settings but bound to ``group``."""
        other = Comm(group, backend=self.backend, env=self.env)
        other._emulated = set(self._emulated)
        return other

    # ---------------------------------------------------------------- helpers
    def _native_or_emulated(self, key: str, native: Callable[[], Any], emulated: Callable[[], Any]) -> Any:
        if key in self._emulated:
            return emulated()
        try:
            return native()
        except (RuntimeError, ValueError, NotImplementedError) as exc:
            text = str(exc).lower()
            if not any(marker in text for marker in _UNSUPPORTED_MARKERS):
                raise
            log.info("backend %s lacks %s (%s); using the exact emulation from now on", self.backend, key, exc)
            self._emulated.add(key)
            return emulated()

    @staticmethod
    def _finish(work: Any, async_op: bool, finish: Callable[[], None]) -> Any:
        if async_op:
            return _PostProcessedWork(work, finish)
        finish()
        return None

    @staticmethod
    def _require_floating(tensor: torch.Tensor, what: str) -> None:
        if not (tensor.is_floating_point() or tensor.is_complex()):
            raise DistributedError(
                f"{what} with op 'avg' needs a floating tensor, got {tensor.dtype}; use op='sum' and divide"
            )

    # ---------------------------------------------------------------- collectives
    def all_reduce(self, tensor: torch.Tensor, op: str | Any = "sum", group: Any = None, async_op: bool = False) -> Any:
        """Reduce ``tensor`` (any shape/dtype) across the group in place; every rank gets the result.

        ``op="avg"`` needs a floating dtype; where the backend lacks AVG it is SUM then ``/= world_size``.

        Returns:
            A work handle when ``async_op`` is True, else ``None``.
        """
        rop = reduce_op(op)
        grp = self._group(group)
        if not _is_avg(rop):
            return dist.all_reduce(tensor, op=rop, group=grp, async_op=async_op)
        self._require_floating(tensor, "all_reduce")

        def emulated() -> Any:
            work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=grp, async_op=async_op)
            return self._finish(work, async_op, lambda: tensor.div_(dist.get_world_size(grp)))

        return self._native_or_emulated(
            "avg", lambda: dist.all_reduce(tensor, op=rop, group=grp, async_op=async_op), emulated
        )

    def reduce_scatter_tensor(
        self,
        output: torch.Tensor,
        input: torch.Tensor,  # noqa: A002 - torch.distributed's name
        op: str | Any = "sum",
        group: Any = None,
        async_op: bool = False,
    ) -> Any:
        """Reduce ``input`` across ranks and keep this rank's equal slice in ``output``.

        Shapes: ``input.numel() == world_size * output.numel()``; rank ``r`` receives elements
        ``[r * n, (r + 1) * n)`` of the flattened reduced input (``n = output.numel()``); same dtype;
        ``output`` contiguous (any shapes otherwise: the tensors are viewed flat).

        Raises:
            DistributedError: the sizes do not match, or ``output`` is not contiguous.
        """
        grp = self._group(group)
        world = dist.get_world_size(grp)
        n = output.numel()
        _require_contiguous(output, "reduce_scatter_tensor")
        if input.numel() != world * n:
            raise DistributedError(
                f"reduce_scatter_tensor: input has {input.numel()} elements, expected world_size ({world}) x "
                f"output ({n}) = {world * n}"
            )
        rop = reduce_op(op)
        if _is_avg(rop):
            self._require_floating(input, "reduce_scatter_tensor")
        native_fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

        def native() -> Any:
            # flat views: gloo checks dim 0 (output.shape[0] * world == input.shape[0]); the contract is numel
            return native_fn(output.view(-1), input.contiguous().view(-1), op=rop, group=grp, async_op=async_op)

        def emulated() -> Any:
            return self._emulated_slice(input.detach().clone().reshape(-1), output, rop, grp, async_op)

        if _is_avg(rop) and "avg" in self._emulated:
            return emulated()
        return self._native_or_emulated("reduce_scatter_tensor", native, emulated)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input_list: Sequence[torch.Tensor],
        op: str | Any = "sum",
        group: Any = None,
        async_op: bool = False,
    ) -> Any:
        """Reduce ``input_list[r]`` across ranks into ``output`` on rank ``r``.

        Shapes: ``len(input_list) == world_size``; every entry has ``output``'s shape and dtype.

        Raises:
            DistributedError: wrong list length or shapes.
        """
        grp = self._group(group)
        world = dist.get_world_size(grp)
        if len(input_list) != world or any(t.shape != output.shape for t in input_list):
            raise DistributedError(
                f"reduce_scatter: expected {world} input tensors of shape {tuple(output.shape)}, got "
                f"{[tuple(t.shape) for t in input_list]}"
            )
        rop = reduce_op(op)
        if _is_avg(rop):
            self._require_floating(output, "reduce_scatter")

        def native() -> Any:
            return dist.reduce_scatter(output, list(input_list), op=rop, group=grp, async_op=async_op)

        def emulated() -> Any:
            full = torch.cat([t.detach().reshape(-1) for t in input_list])
            return self._emulated_slice(full, output, rop, grp, async_op)

        if _is_avg(rop) and "avg" in self._emulated:
            return emulated()
        return self._native_or_emulated("reduce_scatter", native, emulated)

    def _emulated_slice(self, full: torch.Tensor, output: torch.Tensor, rop: Any, grp: Any, async_op: bool) -> Any:
        """All-reduce the flat ``full`` (world_size x output.numel() elements), then copy this rank's slice."""
        world = dist.get_world_size(grp)
        rank = dist.get_rank(grp)
        n = output.numel()
        work = dist.all_reduce(full, op=dist.ReduceOp.SUM if _is_avg(rop) else rop, group=grp, async_op=async_op)

        def finish() -> None:
            piece = full[rank * n : (rank + 1) * n]
            if _is_avg(rop):
                piece = piece / world
            output.copy_(piece.view_as(output))

        return self._finish(work, async_op, finish)

    def all_gather_into_tensor(
        self,
        output: torch.Tensor,
        input: torch.Tensor,  # noqa: A002 - torch.distributed's name
        group: Any = None,
        async_op: bool = False,
    ) -> Any:
        """Concatenate every rank's ``input`` into ``output`` (rank order along the flattened storage).

        Shapes: ``output.numel() == world_size * input.numel()``, same dtype; ``output`` contiguous (any
        shapes otherwise: the tensors are viewed flat).

        Raises:
            DistributedError: the sizes do not match, or ``output`` is not contiguous.
        """
        grp = self._group(group)
        world = dist.get_world_size(grp)
        _require_contiguous(output, "all_gather_into_tensor")
        if output.numel() != world * input.numel():
            raise DistributedError(
                f"all_gather_into_tensor: output has {output.numel()} elements, expected world_size ({world}) x "
                f"input ({input.numel()}) = {world * input.numel()}"
            )
        native_fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

        def native() -> Any:
            return native_fn(output.view(-1), input.contiguous().view(-1), group=grp, async_op=async_op)

        def emulated() -> Any:
            views = [chunk.view_as(input) for chunk in output.view(-1).split(input.numel())]
            return dist.all_gather(views, input, group=grp, async_op=async_op)

        return self._native_or_emulated("all_gather_into_tensor", native, emulated)

    def all_gather(
        self, tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False
    ) -> Any:
        """``tensor_list[r]`` receives rank ``r``'s ``tensor`` (``len(tensor_list) == world_size``, equal shapes)."""
        return dist.all_gather(tensor_list, tensor, group=self._group(group), async_op=async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any:
        """Copy global rank ``src``'s ``tensor`` into ``tensor`` on every rank (in place)."""
        return dist.broadcast(tensor, src=int(src), group=self._group(group), async_op=async_op)

    def all_gather_object(self, obj: Any, group: Any = None) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order."""
        grp = self._group(group)
        out: list[Any] = [None] * dist.get_world_size(grp)
        dist.all_gather_object(out, obj, group=grp)
        return out

    def broadcast_object(self, obj: Any, src: int = 0, group: Any = None) -> Any:
        """Global rank ``src``'s picklable ``obj`` on every rank."""
        box = [obj]
        dist.broadcast_object_list(box, src=int(src), group=self._group(group))
        return box[0]

    def barrier(self, group: Any = None) -> None:
        """Block until every rank of the group reaches the barrier."""
        dist.barrier(group=self._group(group))

    def destroy(self) -> bool:
        """Destroy the default process group if dscore created it and this facade is bound to it.

        A group the user created is left alone (it is the user's to destroy). Returns True when the
        group was destroyed.
        """
        if self.group is not None:
            return False
        from dscore.comm.init import PROCESS_GROUP_OWNER

        return PROCESS_GROUP_OWNER.destroy("Comm.destroy() was called")
