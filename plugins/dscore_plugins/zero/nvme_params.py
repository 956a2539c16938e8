"""ZeRO-3 parameter offload to NVMe (``zero_optimization.offload_param.device: "nvme"``).

DeepSpeed's ZeRO-Infinity parameter swapper, restated on :class:`dscore.zero.partition.FlatUnit`: each
non-persistent unit's partition (this rank's ``1/world`` of the unit, in the compute dtype) lives in its
own swap file under ``<nvme_path>/dscore-swap-<run id>/rank<N>/``. The unit's ``partition_source`` hook
makes it resident just before the unit reads or writes its partition (all-gather, refresh, write-back):
read ahead by :meth:`NVMeParamSwapper.prefetch` (the stage names the units of the next modules in its
traced order, at most ``buffer_count`` of them in flight) or read on demand. At most ``max_in_cpu``
partition elements stay resident, least recently used first out (written back only when modified);
a partition larger than ``buffer_size`` elements is refused, as DeepSpeed refuses parameters larger
than its swap buffers. Persistent units (``stage3_param_persistence_threshold``) stay in memory.

The optimizer step's new values reach the partitions through :meth:`NVMeParamSwapper.write_range`
(a resident partition is updated in memory, an evicted one written straight to its file).
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from dscore.errors import ConfigError, DscoreError
from dscore.swap_folders import record_swap_root

__all__ = ["NVMeParamSwapper", "attach"]

log = logging.getLogger("dscore.zero")


class NVMeParamSwapper:
    """Keeps stage-3 unit partitions in swap files, resident only around their use.

    Args:
        units: the units to offload (1-D CPU partitions of ``unit.chunk`` elements).
        folder: the ``offload_param.nvme_path``.
        aio: the ``aio`` section (or None). run_id, rank: name the swap folder (see the optimizer's).
        buffer_count: partitions read ahead at most. buffer_size: largest partition allowed (elements).
        max_in_cpu: partition elements kept resident at most (least recently used leave first).
        pin_memory: page-locked buffers where a device runtime can pin.

    Raises:
        ConfigError: a partition larger than ``buffer_size`` (``zero_optimization.offload_param.buffer_size``).
        AsyncIOError: the swap folder or files cannot be written.
    """

    def __init__(
        self,
        units: Sequence[Any],
        *,
        folder: str | os.PathLike[str],
        aio: Any = None,
        run_id: str | None = None,
        rank: int = 0,
        buffer_count: int = 5,
        buffer_size: int = 100_000_000,
        max_in_cpu: int = 1_000_000_000,
        pin_memory: bool = False,
    ) -> None:
        from dscore_plugins.zero.nvme_swap import NVMeSwapManager

        self.units = list(units)
        big = max((u.chunk for u in self.units), default=0)
        if big > buffer_size:
            raise ConfigError(
                f"zero_optimization.offload_param.buffer_size = {buffer_size} elements is smaller than the largest "
                f"parameter partition ({big} elements on each of {self.units[0].world} ranks); raise it to at least "
                f"{big}",
                path="zero_optimization.offload_param.buffer_size",
            )
        for u in self.units:
            if u.partition.device.type != "cpu":
                raise DscoreError(f"NVMeParamSwapper: unit {u.name!r} has its partition on {u.partition.device}, not the CPU")
        self.max_in_cpu = int(max_in_cpu)
        self.closed = False
        self._name = {id(u): f"unit{i:06d}" for i, u in enumerate(self.units)}
        self._resident: OrderedDict[int, Any] = OrderedDict()  # LRU order
        self._resident_elems = 0
        self._dirty: set[int] = set()
        self.reads = 0
        self.writes = 0
        self.swap = NVMeSwapManager(folder, aio=aio, run_id=run_id, rank=rank, buffer_count=int(buffer_count),
                                    pin_memory=pin_memory)
        try:
            for u in self.units:
                self.swap.swap_out(self._name[id(u)], u.partition.detach().clone(), async_op=True)
            self.swap.wait_writes()
        except BaseException:
            self.swap.close()
            raise
        for u in self.units:
            u.partition = self._placeholder(u)
            u.partition_source = self.acquire
            u.on_modified.append(self._modified)
        log.info("NVMe parameter offload: %d unit partition(s), %d elements in %s (max_in_cpu %d)",
                 len(self.units), sum(u.chunk for u in self.units), self.swap.folder, self.max_in_cpu)

    @property
    def folder(self) -> Path:
        """This rank's swap folder."""
        return self.swap.folder

    def resident_elements(self) -> int:
        """Partition elements held in memory now."""
        return self._resident_elems

    # ------------------------------------------------------------------ residency
    def acquire(self, unit: Any) -> None:
        """Make ``unit.partition`` hold its values (the unit's ``partition_source`` hook).

        Raises:
            AsyncIOError: the read failed (naming the file). DscoreError: the swapper is closed.
        """
        key = id(unit)
        if key in self._resident:
            self._resident.move_to_end(key)
            return
        if self.closed:
            raise DscoreError(f"unit {unit.name!r}: its partition is in a closed NVMe swap folder (engine.close() ran)")
        name = self._name[key]
        unit.partition = self.swap.swap_in(name)
        self.reads += 1
        self._resident[key] = unit
        self._resident_elems += unit.chunk
        self._evict_beyond(self.max_in_cpu, keep=key)

    def prefetch(self, units: Iterable[Any]) -> None:
        """Start reading the partitions of ``units`` (in order) that are neither resident nor being read,
        while read-ahead buffers are free (``buffer_count``)."""
        if self.closed:
            return
        for u in units:
            key = id(u)
            if key in self._resident or key not in self._name:
                continue
            name = self._name[key]
            if self.swap.is_prefetched(name):
                continue
            if self.swap.free_read_buffers() <= 0:
                return
            self.swap.prefetch(name)

    def write_range(self, units: Sequence[Any], offsets: Sequence[int], start: int, values: torch.Tensor) -> None:
        """Write ``values`` (elements ``[start, start + n)`` of a group partition laid out as ``units`` at
        ``offsets``) into the units' partitions: in memory when resident, else straight to the swap file.

        A unit only partly covered by the range is made resident first (read, patched)."""
        flat = values.detach().reshape(-1)
        end = start + flat.numel()
        for u, off in zip(units, offsets):
            a, b = max(start, off), min(end, off + u.chunk)
            if a >= b:
                continue
            piece = flat[a - start : b - start]
            key = id(u)
            if key not in self._name:  # not offloaded (persistent): an ordinary partition
                with torch.no_grad():
                    u.partition[a - off : b - off].copy_(piece)
                continue
            if key not in self._resident and (a, b) == (off, off + u.chunk):
                self.swap.swap_out(self._name[key], piece.to(u.dtype).contiguous())
                self.writes += 1
                continue
            self.acquire(u)
            with torch.no_grad():
                u.partition[a - off : b - off].copy_(piece)
            self._dirty.add(key)

    def read(self, unit: Any) -> torch.Tensor:
        """A copy of ``unit``'s partition values (read from swap when evicted)."""
        if id(unit) in self._name:
            self.acquire(unit)
        return unit.partition.detach().clone()

    def _modified(self, unit: Any) -> None:
        self._dirty.add(id(unit))

    def _evict_beyond(self, limit: int, keep: int | None = None) -> None:
        for key in list(self._resident):
            if self._resident_elems <= limit:
                return
            if key == keep:
                continue
            self._evict(self._resident[key])

    def _evict(self, unit: Any) -> None:
        key = id(unit)
        unit.wait()  # an all-gather in flight may still read the partition
        if key in self._dirty:
            self.swap.swap_out(self._name[key], unit.partition.contiguous())
            self.writes += 1
            self._dirty.discard(key)
        unit.partition = self._placeholder(unit)
        del self._resident[key]
        self._resident_elems -= unit.chunk

    @staticmethod
    def _placeholder(unit: Any) -> torch.Tensor:
        # no storage: anything reading the partition without the hook fails loudly (size mismatch)
        return torch.empty(0, dtype=unit.dtype)

    def close(self) -> None:
        """Remove the swap folder (idempotent). Resident partitions stay usable; the others are gone."""
        if self.closed:
            return
        self.closed = True
        self.swap.close()

    def __enter__(self) -> NVMeParamSwapper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def attach(ctx: Any, units: Sequence[Any], rank: int) -> NVMeParamSwapper | None:
    """Move ``units``' partitions to NVMe when ``zero_optimization.offload_param.device`` is ``"nvme"``
    (else None). Collective over ``ctx.comm`` (the run id).

    Raises:
        ConfigError: ``offload_param.nvme_path`` missing or not writable; ``buffer_size`` too small.
    """
    from dscore_plugins.zero.nvme_optimizer import agree_run_id, check_nvme_path

    block = ctx.section.offload_param
    if block is None or block.device != "nvme":
        return None
    run_id = agree_run_id(ctx.comm)
    folder = check_nvme_path(block.nvme_path, "zero_optimization.offload_param.nvme_path")
    record_swap_root(folder)
    return NVMeParamSwapper(
        units, folder=folder, aio=ctx.config.section("aio"), run_id=run_id, rank=rank,
        buffer_count=int(block.buffer_count), buffer_size=int(block.buffer_size), max_in_cpu=int(block.max_in_cpu),
        pin_memory=bool(block.pin_memory) and ctx.accelerator.supports_pinned_memory(),
    )
