"""Flat, padded, world-partitioned parameter units: the storage model of ZeRO stage 3.

A :class:`FlatUnit` holds a list of parameters (typically one module's direct parameters) as one 1-D
buffer ``full`` of ``padded = chunk * world`` elements, laid out parameter after parameter (then zero
padding). Rank ``r`` permanently owns only ``full[r*chunk:(r+1)*chunk]`` (its *partition*, ``chunk =
ceil(numel / world)`` elements). The parameters themselves are views into ``full``: releasing the unit
shrinks ``full``'s storage to 0 bytes (the views, and any autograd-saved views of them, stay valid
objects) and gathering re-grows the storage and fills it with one ``all_gather_into_tensor`` of every
rank's partition (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", §5.3: P_os+g+p). How the partitions travel is the unit's :class:`GatherStrategy`: the
plain :class:`AllGather` by default; a plugin may set another (the ZeRO plugin's ZeRO++ strategies gather
inside a smaller group from kept copies, hpZ, or send int8 blocks, qwZ). Because the parameters' metadata never changes, autograd graphs that
saved a parameter (or a view of it) during forward read the re-gathered values during backward.

This is core code (no plugin imports): :mod:`dscore.zero.init` builds units at module construction and
the stage-3 plugin builds and drives them during training.
"""

from __future__ import annotations

import enum
import itertools
import math
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch

from dscore.comm import Comm, Work
from dscore.zero.buffer_cache import GatherBufferCache
from dscore.zero.layout import packed_offsets
from dscore.zero.released import mark_available, mark_released

__all__ = ["ALL_GATHER", "AllGather", "FlatUnit", "GatherStrategy", "ZeroParamStatus", "unit_of", "is_partitioned"]

_UNIT_ATTR = "_dscore_unit"

# DeepSpeed numbers partitioned parameters in creation order (``param.ds_id``)
_PARAM_IDS = itertools.count()


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


class GatherStrategy(Protocol):
    """How a :class:`FlatUnit`'s full buffer is filled from the ranks' partitions (``FlatUnit.gather_strategy``).

    The unit calls :meth:`launch` for every gather and re-gather (``full``'s storage is already allocated,
    ``padded`` elements of the unit's dtype) and :meth:`invalidate` whenever this rank's partition was
    written or reloaded (:meth:`FlatUnit.load_full`, :meth:`FlatUnit.refresh`, :meth:`FlatUnit.write_back`),
    so a strategy that keeps something derived from earlier gathers drops it. A strategy must issue the
    same collectives on every rank of ``unit.comm`` for the same call sequence.
    """

    def launch(self, unit: FlatUnit, *, exact: bool) -> tuple[Work | None, bool]:
        """Start filling ``unit.full`` with every rank's partition, in rank order.

        Args:
            unit: the unit being gathered (:meth:`FlatUnit.source` gives this rank's partition to send).
            exact: True: ``full`` must receive the partitions bit for bit (checkpoints, user gathers, the
                re-gather after a step). False: the training hooks' gathers, which may receive an
                approximation (e.g. int8 blocks).

        Returns:
            the work whose ``wait()`` completes ``full`` (None when ``full`` is already complete), and
            whether the values it gives are exact.
        """
        ...

    def invalidate(self, unit: FlatUnit) -> None:
        """``unit``'s partition changed: forget anything kept from its earlier gathers."""
        ...


class AllGather:
    """The plain gather: one ``all_gather_into_tensor`` of every rank's partition over ``unit.comm``
    (always exact; keeps nothing between gathers)."""

    def launch(self, unit: FlatUnit, *, exact: bool) -> tuple[Work | None, bool]:
        """All-gather :meth:`FlatUnit.source` into ``unit.full`` (asynchronous); the result is exact."""
        return unit.comm.all_gather_into_tensor(unit.full, unit.source(), async_op=True), True

    def invalidate(self, unit: FlatUnit) -> None:
        """Nothing is kept between gathers, so nothing goes stale."""
        return None


#: the default :class:`GatherStrategy` of every unit (stateless, shared).
ALL_GATHER = AllGather()


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
        gather_strategy: how gathers fill ``full`` (:class:`GatherStrategy`; default :data:`ALL_GATHER`).
        approximate: True while ``full`` holds an inexact gather (``gather(exact=False)`` through a strategy
            that approximates); such values are never written back.
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
        #: ids of the modules whose forward is using this unit (every parameter's ``ds_active_sub_modules``)
        self.active_sub_modules: set[int] = set()
        #: GatheredParameters contexts holding the unit gathered; training code does not release it meanwhile
        self.holds = 0
        #: True when a GatheredParameters context gathered the unit (released when the last hold ends)
        self.held_gather = False
        self._partition = partition
        self.gathered = True
        self.persistent = False
        self.on_modified: list[Callable[[FlatUnit], None]] = []
        self.partition_source: Callable[[FlatUnit], None] | None = None
        self.buffer_cache: GatherBufferCache | None = None
        self.gather_strategy: GatherStrategy = ALL_GATHER
        self.approximate = False
        self._handle: Work | None = None
        self.bind_views()

    # ------------------------------------------------------------------ layout
    @property
    def partition(self) -> torch.Tensor:
        """This rank's ``chunk`` elements of the unit (1-D). Assigning it re-points every parameter's
        ``ds_tensor``."""
        return self._partition

    @partition.setter
    def partition(self, value: torch.Tensor) -> None:
        self._partition = value
        self._bind_partition_views()

    def _bind_partition_views(self) -> None:
        # param.ds_tensor: the parameter's elements inside this rank's chunk (DeepSpeed partitions each
        # parameter by itself; here a parameter's share of the unit's chunk, possibly empty)
        lo = self.rank * self.chunk
        part = self._partition
        whole = part.numel() == self.chunk
        for p, off, n in zip(self.params, self.offsets, self.numels):
            a, b = max(off, lo) - lo, min(off + n, lo + self.chunk) - lo
            p.ds_tensor = part[a:b] if whole and b > a else part[0:0]  # type: ignore[attr-defined]

    def bind_views(self) -> None:
        """Point every parameter's ``.data`` at its slice of ``full`` and tag it with this unit (and the
        DeepSpeed attributes ``ds_shape``, ``ds_numel``, ``ds_status``, ``ds_id``, ``ds_tensor``,
        ``ds_active_sub_modules``, ``partition_numel()``)."""
        for p, shape, off, n in zip(self.params, self.shapes, self.offsets, self.numels):
            p.data = self.full[off : off + n].view(shape)
            p.ds_shape = shape  # type: ignore[attr-defined]
            p.ds_numel = n  # type: ignore[attr-defined]
            if not hasattr(p, "ds_id"):  # kept when zero.Init's unit is re-laid out by the stage
                p.ds_id = next(_PARAM_IDS)  # type: ignore[attr-defined]
            p.ds_active_sub_modules = self.active_sub_modules  # type: ignore[attr-defined]
            p.ds_status = ZeroParamStatus.AVAILABLE if self.gathered else ZeroParamStatus.NOT_AVAILABLE  # type: ignore[attr-defined]
            (mark_available if self.gathered else mark_released)(p)
            lo, hi = self.rank * self.chunk, (self.rank + 1) * self.chunk
            p.partition_numel = _Count(max(0, min(off + n, hi) - max(off, lo)))  # type: ignore[attr-defined]
            setattr(p, _UNIT_ATTR, self)
        self._bind_partition_views()

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
        self.approximate = False
        self.gather_strategy.invalidate(self)

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

    def gather(self, *, async_op: bool = False, exact: bool = True) -> None:
        """Make the full parameters available (through :attr:`gather_strategy`). No-op when gathered, except
        that an exact gather of a unit holding an approximate gather gathers again, exactly.

        Args:
            exact: False lets the strategy give an approximation (the training hooks' gathers, e.g. ZeRO++
                quantized weights); checkpoints and user gathers stay exact.
        """
        self._refuse_freed()
        if self.gathered:
            if self.approximate and exact:
                self.wait()
                self._launch(async_op)
                self._set_status(ZeroParamStatus.INFLIGHT)
            if not async_op:
                self.wait()
            return
        self._ensure_storage()
        self._launch(async_op, exact)
        self.gathered = True
        self._set_status(ZeroParamStatus.INFLIGHT)
        if not async_op:
            self.wait()

    def _refuse_freed(self) -> None:
        """Raise before reading a storage ``engine.offload_states()`` freed (the partition, or the full buffer
        of a unit that stays gathered): torch would fail on the 0-byte storage, or a collective read it.

        Raises:
            EngineError: names the unit and ``reload_states()``.
        """
        freed = self.partition.numel() > 0 and self.partition.untyped_storage().nbytes() == 0
        if self.partition_source is None and (freed or (self.gathered and self.full.untyped_storage().nbytes() == 0)):
            from dscore.runtime.engine_errors import EngineError

            raise EngineError(
                f"gathering ZeRO-3 parameter unit {self.name!r}: its "
                "storage was freed by engine.offload_states(); call reload_states() first (GatheredParameters, "
                "state dicts and checkpoints need the states on the device)"
            )

    def _launch(self, async_op: bool, exact: bool = True) -> None:
        self._handle, got_exact = self.gather_strategy.launch(self, exact=exact)
        self.approximate = not got_exact

    def source(self) -> torch.Tensor:
        """This rank's partition, ready to send into ``full``: runs :attr:`partition_source` first and
        copies a host partition (parameter offload) to ``full``'s device (non-blocking). ``chunk`` elements
        of the unit's dtype; a view of :attr:`partition` when already on that device."""
        if self.partition_source is not None:
            self.partition_source(self)
        src = self.partition
        if src.device != self.full.device:  # parameter offload: partition lives on the host
            src = src.to(self.full.device, non_blocking=True)
        return src

    def refresh(self, *, async_op: bool = False) -> None:
        """Re-gather a gathered unit after its partition changed (e.g. after an optimizer step)."""
        if not self.gathered:
            return
        self.wait()
        self.gather_strategy.invalidate(self)  # the partition changed: anything kept is stale
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
            RuntimeError: ``full`` holds an approximate gather (writing it back would lose precision).
        """
        self.wait()
        if self.approximate:
            raise RuntimeError(f"unit {self.name!r}: write_back of an approximate gather; gather(exact=True) first")
        if self.partition_source is not None:
            self.partition_source(self)
        with torch.no_grad():
            self.partition.copy_(self.own_slice())
        self.gather_strategy.invalidate(self)
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
