"""Flat, padded, world-partitioned parameter units: the storage model of ZeRO stage 3.

A :class:`FlatUnit` holds a list of parameters (typically one module's direct parameters) as one 1-D
buffer ``full`` of ``padded = chunk * world`` elements, laid out parameter after parameter (then zero
padding). Rank ``r`` permanently owns only ``full[r*chunk:(r+1)*chunk]`` (its *partition*, ``chunk =
ceil(numel / world)`` elements). The parameters themselves are views into ``full``: releasing the unit
shrinks ``full``'s storage to 0 bytes (the views, and any autograd-saved views of them, stay valid
objects) and gathering re-grows the storage and fills it with one ``all_gather_into_tensor`` of every
rank's partition (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", §5.3: P_os+g+p). Because the parameters' metadata never changes, autograd graphs that
saved a parameter (or a view of it) during forward read the re-gathered values during backward.

This is core code (no plugin imports): :mod:`dscore.zero.init` builds units at module construction and
the stage-3 plugin (``dscore_plugins.zero.stage3``) builds and drives them during training.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from dscore.comm import Comm, Work
from dscore.zero.buffer_cache import GatherBufferCache
from dscore.zero.layout import packed_offsets
from dscore.zero.released import mark_available, mark_released

if TYPE_CHECKING:
    from dscore.zero.hpz import SecondaryPartition

__all__ = ["FlatUnit", "ZeroParamStatus", "unit_of", "is_partitioned"]

_UNIT_ATTR = "_dscore_unit"


class ZeroParamStatus(enum.Enum):
    """Whether a partitioned parameter's full value is present (DeepSpeed's ``param.ds_status`` values):
    ``AVAILABLE`` gathered, ``NOT_AVAILABLE`` released (only the partition exists), ``INFLIGHT`` a gather was
    launched and not yet waited for."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


def unit_of(param: torch.Tensor) -> FlatUnit | None:
    """The :class:`FlatUnit` that stores ``param``, or None when it is an ordinary tensor."""
    return getattr(param, _UNIT_ATTR, None)


def is_partitioned(param: torch.Tensor) -> bool:
    """True when ``param`` belongs to a :class:`FlatUnit` (its data may be released)."""
    return unit_of(param) is not None


class FlatUnit:
    """Parameters stored as one padded flat buffer, partitioned into ``world`` equal chunks.

    Args:
        params: the parameters (any shapes; their current values are *not* read here, see
            :meth:`load_full`). Each gets attributes ``ds_shape`` (torch.Size), ``ds_numel`` (int) and a
            back-reference used by :func:`unit_of`.
        comm: the data-parallel group's :class:`dscore.comm.Comm` (rank and world size are read once).
        dtype: dtype of ``full`` and the partition (the compute dtype).
        device: device of ``full`` and the partition.
        partition: optional 1-D tensor of ``chunk`` elements to use as this rank's partition storage (a
            view into a larger per-group buffer); allocated when None.
        name: for logging and errors.

    Attributes:
        numel: real elements (sum of parameter numels).
        chunk: elements per rank, ``ceil(numel / world)``.
        padded: ``chunk * world`` (length of ``full``).
        offsets: start of each parameter inside ``full`` (elements).
        gathered: True while ``full`` holds real storage (possibly with a gather still in flight).
        persistent: when True, training code never releases the unit.
        on_modified: callbacks run after :meth:`write_back` (e.g. to refresh fp32 master weights).
        partition_source: None, or a callback run before the partition is read or written (gather,
            refresh, write-back) that makes ``partition`` hold this rank's values (NVMe parameter offload
            keeps it in a swap file otherwise).
        buffer_cache: None, or a :class:`~dscore.zero.buffer_cache.GatherBufferCache` that gathers take
            ``full``'s memory from and releases give it back to (stage 3 on the host); None allocates
            and frees with ``resize_``.
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        comm: Comm,
        *,
        dtype: torch.dtype,
        device: torch.device,
        partition: torch.Tensor | None = None,
        name: str = "",
    ) -> None:
        self.params = list(params)
        self.comm = comm
        self.rank = comm.rank
        self.world = comm.world_size
        self.name = name
        self.dtype = dtype
        self.device = torch.device(device)
        self.shapes = [torch.Size(p.ds_shape) if hasattr(p, "ds_shape") else p.shape for p in self.params]
        self.numels = [int(math.prod(s)) for s in self.shapes]
        self.offsets, self.numel = packed_offsets(self.numels)
        self.chunk = max(1, math.ceil(self.numel / self.world))
        self.padded = self.chunk * self.world
        self.full = torch.zeros(self.padded, dtype=dtype, device=self.device)
        if partition is None:
            partition = torch.zeros(self.chunk, dtype=dtype, device=self.device)
        if partition.numel() != self.chunk or partition.dtype != dtype:
            raise ValueError(
                f"partition for unit {name!r} must be {self.chunk} elements of {dtype}, "
                f"got {partition.numel()} of {partition.dtype}"
            )
        self.partition = partition
        self.gathered = True
        self.persistent = False
        self.on_modified: list[Callable[[FlatUnit], None]] = []
        self.partition_source: Callable[[FlatUnit], None] | None = None
        self.buffer_cache: GatherBufferCache | None = None
        #: > 0: gathers send int8 blocks of this many elements plus fp32 scales (ZeRO++ quantized
        #: weights, :mod:`dscore.zero.quantize`); the partition itself stays exact
        self.quantize_block = 0
        self.quantized_view = False  # ``full`` holds a quantized gather (never written back)
        #: None, or this unit's ZeRO++ hpZ secondary partition (:mod:`dscore.zero.hpz`): a gather reads it
        #: inside the smaller hpZ group while it holds a copy of the unit's current values of that kind
        self.secondary: SecondaryPartition | None = None
        self._handle: Work | None = None
        self.bind_views()

    # ------------------------------------------------------------------ layout
    def bind_views(self) -> None:
        """Point every parameter's ``.data`` at its slice of ``full`` and tag it with this unit."""
        for p, shape, off, n in zip(self.params, self.shapes, self.offsets, self.numels):
            p.data = self.full[off : off + n].view(shape)
            p.ds_shape = shape  # type: ignore[attr-defined]
            p.ds_numel = n  # type: ignore[attr-defined]
            p.ds_status = ZeroParamStatus.AVAILABLE if self.gathered else ZeroParamStatus.NOT_AVAILABLE  # type: ignore[attr-defined]
            (mark_available if self.gathered else mark_released)(p)
            lo, hi = self.rank * self.chunk, (self.rank + 1) * self.chunk
            p.partition_numel = _Count(max(0, min(off + n, hi) - max(off, lo)))  # type: ignore[attr-defined]
            setattr(p, _UNIT_ATTR, self)

    def _set_status(self, status: ZeroParamStatus) -> None:
        # a released parameter's class refuses torch calls on its absent values (dscore.zero.released)
        mark = mark_released if status is ZeroParamStatus.NOT_AVAILABLE else mark_available
        for p in self.params:
            p.ds_status = status  # type: ignore[attr-defined]
            mark(p)

    def own_slice(self) -> torch.Tensor:
        """This rank's chunk of ``full`` (a view; valid only while gathered)."""
        r = self.rank
        return self.full[r * self.chunk : (r + 1) * self.chunk]

    def load_full(self, values: list[torch.Tensor]) -> None:
        """Fill ``full`` from full parameter values (same order and shapes) and copy this rank's chunk
        into the partition. Every rank must pass identical values. Leaves the unit gathered."""
        self._ensure_storage()
        with torch.no_grad():
            for v, off, n in zip(values, self.offsets, self.numels):
                self.full[off : off + n].copy_(v.reshape(-1))
            self.full[self.numel :].zero_()
            self.partition.copy_(self.own_slice())
        self.gathered = True
        self._set_status(ZeroParamStatus.AVAILABLE)
        self.quantized_view = False
        if self.secondary is not None:
            self.secondary.drop()

    # ------------------------------------------------------------------ gather / release
    def _ensure_storage(self) -> None:
        storage = self.full.untyped_storage()
        nbytes = self.padded * self.full.element_size()
        if storage.nbytes() == nbytes:
            return
        if self.buffer_cache is not None and storage.nbytes() == 0:
            self.buffer_cache.fill(storage, nbytes)
        else:
            storage.resize_(nbytes)

    def gather(self, *, async_op: bool = False, quantized: bool = False) -> None:
        """Make the full parameters available (all-gather of the partitions). No-op when gathered, except
        that an exact gather of a unit holding a quantized gather gathers again, exactly.

        Args:
            quantized: allow the ZeRO++ quantized gather (when :attr:`quantize_block` is set): the training
                hooks' gathers; checkpoints and user gathers stay exact.
        """
        if self.gathered:
            if self.quantized_view and not quantized:
                self.wait()
                self._launch(async_op)
                self._set_status(ZeroParamStatus.INFLIGHT)
            if not async_op:
                self.wait()
            return
        self._ensure_storage()
        self._launch(async_op, quantized)
        self.gathered = True
        self._set_status(ZeroParamStatus.INFLIGHT)
        if not async_op:
            self.wait()

    def _launch(self, async_op: bool, quantized: bool = False) -> None:
        self.quantized_view = bool(quantized and self.quantize_block)
        sec = self.secondary
        if sec is not None:  # hpZ: gather inside the smaller group while a copy of this kind is kept
            work = sec.launch(self.quantized_view)
            if work is not None:
                self._handle = work
                return
        if self.partition_source is not None:
            self.partition_source(self)
        src = self.partition
        if src.device != self.full.device:  # parameter offload: partition lives on the host
            src = src.to(self.full.device, non_blocking=True)
        if self.quantized_view:
            self._handle = self._launch_quantized(src)
            return
        work = self.comm.all_gather_into_tensor(self.full, src, async_op=True)
        self._handle = work if sec is None else Work([work], sec.keep_exact)

    def _launch_quantized(self, src: torch.Tensor) -> Work:
        """All-gather int8 blocks and their scales; the returned work dequantizes into ``full`` when waited."""
        from dscore.zero.quantize import quantize_int8_blockwise

        block, world = self.quantize_block, self.world
        q, scales = quantize_int8_blockwise(src, block)
        q_all = torch.empty(world * q.numel(), dtype=torch.int8, device=self.full.device)
        s_all = torch.empty(world * scales.numel(), dtype=torch.float32, device=self.full.device)
        works = [
            self.comm.all_gather_into_tensor(q_all, q, async_op=True),
            self.comm.all_gather_into_tensor(s_all, scales, async_op=True),
        ]
        sec = self.secondary

        def finish() -> None:
            self.dequantize_gathered(q_all, s_all)
            if sec is not None:
                sec.keep_quantized(q_all, s_all)

        return Work(works, finish)

    def dequantize_gathered(self, q_all: torch.Tensor, s_all: torch.Tensor) -> None:
        """Write a quantized gather into ``full``: ``q_all`` int8 ``[world · blocks · block]`` and ``s_all``
        fp32 ``[world · blocks]``, every rank's chunk in rank order (:mod:`dscore.zero.quantize`)."""
        from dscore.zero.quantize import dequantize_int8_blockwise

        block, world, chunk, full = self.quantize_block, self.world, self.chunk, self.full
        for r, (qr, sr) in enumerate(zip(q_all.chunk(world), s_all.chunk(world))):
            dequantize_int8_blockwise(qr, sr, full[r * chunk : (r + 1) * chunk], block)

    def refresh(self, *, async_op: bool = False) -> None:
        """Re-gather a gathered unit after its partition changed (e.g. after an optimizer step)."""
        if not self.gathered:
            return
        self.wait()
        if self.secondary is not None:  # the partition changed: a kept copy is stale
            self.secondary.drop()
        self._launch(async_op)
        if not async_op:
            self.wait()

    def wait(self) -> None:
        """Wait for an in-flight gather (no-op otherwise)."""
        if self._handle is not None:
            self._handle.wait()
            self._handle = None
            self._set_status(ZeroParamStatus.AVAILABLE)

    def release(self) -> None:
        """Free the full buffer's storage (the partition stays). No-op when already released."""
        if not self.gathered:
            return
        self.wait()
        if self.buffer_cache is not None:
            self.buffer_cache.drain(self.full.untyped_storage())
        else:
            self.full.untyped_storage().resize_(0)
        self.gathered = False
        self._set_status(ZeroParamStatus.NOT_AVAILABLE)

    def write_back(self) -> None:
        """Copy this rank's chunk of the (gathered, possibly modified) full buffer into the partition and
        run :attr:`on_modified` callbacks.

        Raises:
            RuntimeError: ``full`` holds a quantized gather (writing it back would lose precision).
        """
        self.wait()
        if self.quantized_view:
            raise RuntimeError(f"unit {self.name!r}: write_back of a quantized gather; gather(quantized=False) first")
        if self.partition_source is not None:
            self.partition_source(self)
        with torch.no_grad():
            self.partition.copy_(self.own_slice())
        if self.secondary is not None:
            self.secondary.drop()
        for cb in self.on_modified:
            cb(self)

    def full_values(self) -> list[torch.Tensor]:
        """Views of the full parameters (valid while gathered), in :attr:`params` order."""
        return [self.full[o : o + n].view(s) for o, n, s in zip(self.offsets, self.numels, self.shapes)]

    def __repr__(self) -> str:
        return (
            f"FlatUnit({self.name!r}, params={len(self.params)}, numel={self.numel}, chunk={self.chunk}, "
            f"gathered={self.gathered}, persistent={self.persistent})"
        )


def _param_groups_of(module_or_params: Any) -> list[torch.nn.Parameter]:
    if isinstance(module_or_params, torch.nn.Module):
        return list(module_or_params.parameters())
    if isinstance(module_or_params, torch.Tensor):
        return [module_or_params]  # type: ignore[list-item]
    return list(module_or_params)


class _Count:
    """``param.partition_numel()``: elements of the parameter held in this rank's partition (a callable, as
    DeepSpeed's method; here it is the parameter's overlap with this rank's chunk of its unit)."""

    __slots__ = ("value",)

    def __init__(self, value: int) -> None:
        self.value = value

    def __call__(self) -> int:
        return self.value

    def __repr__(self) -> str:
        return f"partition_numel() -> {self.value}"
