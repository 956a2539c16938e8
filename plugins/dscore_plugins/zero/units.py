"""ZeRO stage 3's units: every module's direct parameters as flat partitioned units, and their groups.

Every module's direct parameters (``recurse=False``), split by optimizer group (frozen parameters form
their own unit), become one :class:`Stage3Unit` (a :class:`dscore.zero.partition.FlatUnit`): a padded flat
buffer of which this rank permanently stores ``1/world`` (its chunk). Parameters built under
:class:`dscore.zero.Init` arrive already partitioned and are re-laid out one module at a time, so the full
model never exists on one rank. This rank's chunks of all units of an optimizer group are one flat
partition tensor; the fp32 master weights, fp32 gradient partition and optimizer state have the same
layout (the master *is* that partition under fp32 without offload). A ZeRO-3 leaf module gets the units
of its whole subtree. ZeRO++ options set on a unit here: the qwZ gather strategy (``zero_feature:qwz``) and
hpZ's secondary partition (``zero_feature:hpz``), both built by the stage through the registry.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from dscore.comm import Comm
from dscore.zero.layout import GroupLayout, Segment
from dscore.zero.leaf import z3_leaf_module
from dscore.zero.partition import FlatUnit, unit_of
from dscore.zero.reducer import ReduceBucket
from dscore_plugins.zero.experts import expert_comm
from dscore_plugins.zero.nvme_optimizer import write_master as nvme_write_master
from dscore_plugins.zero.offload import host_tensor

__all__ = ["FROZEN", "Stage3Unit", "UnitBucket", "UnitState", "Units"]

log = logging.getLogger("dscore.zero")

#: the optimizer-group key of frozen parameters' units
FROZEN = -1


class Stage3Unit(FlatUnit):
    """A stage-3 unit: a :class:`~dscore.zero.partition.FlatUnit` that records its ZeRO++ qwZ block.

    Attributes:
        quantize_block: elements per int8 block of its training gathers (ZeRO++ qwZ, set with its gather
            strategy), 0 when they are exact.
    """

    def __init__(
        self, params: list[torch.nn.Parameter], comm: Comm, *, dtype: torch.dtype, device: torch.device, name: str = ""
    ) -> None:
        super().__init__(params, comm, dtype=dtype, device=device, name=name)
        self.quantize_block = 0


class UnitState:
    """Training-time bookkeeping of one unit: its optimizer group and place in the group partition."""

    __slots__ = ("unit", "key", "trainable", "index", "part_offset")

    def __init__(self, unit: FlatUnit, key: int, index: int) -> None:
        self.unit = unit
        self.key = key
        self.index = index
        self.trainable = key != FROZEN
        self.part_offset = 0


class UnitBucket(ReduceBucket):
    """The reduce bucket of one trainable unit (its gradients, padded like the unit's flat buffer)."""

    def __init__(self, state: UnitState, target: torch.Tensor, pad_to: int) -> None:
        u = state.unit
        super().__init__(u.params, pad_to=pad_to, dtype=u.dtype, device=u.device, target=target, numels=u.numels)
        self.state = state


class Units:
    """Part of :class:`~dscore_plugins.zero.stage3.Stage3`: building its units and their group partitions,
    masters and layouts, and moving values between masters and partitions.

    The stage sets the attributes annotated here before calling :meth:`_make_units` (per module),
    :meth:`_merge_leaves` and :meth:`_consolidate`.
    """

    ctx: Any
    comm: Comm
    compute_dtype: torch.dtype
    device: torch.device
    group_params: list[list[torch.nn.Parameter]]
    group_comms: list[Comm]
    _mesh: Any
    persistence_threshold: int
    quantize_weights: bool
    quantize_frozen: bool
    qwz: Callable[[FlatUnit], Any] | None
    hpz: Any
    offload_param: bool
    offload_opt: bool
    nvme_param: bool
    pin_param: bool
    pin_opt: bool
    names: dict[int, str]
    units: list[UnitState]
    by_unit: dict[int, UnitState]
    module_units: dict[torch.nn.Module, list[UnitState]]
    module_names: dict[torch.nn.Module, str]
    _pswap: Any
    _optimizer: torch.optim.Optimizer | None

    def _merge_leaves(self, module: torch.nn.Module) -> set[int]:
        """Give each outermost ZeRO-3 leaf module the units of its whole subtree and take its submodules'
        away (they get no hooks). Marks the leaf's parameters (``ds_z3_leaf_module``, as DeepSpeed).

        Returns:
            ``id`` of every unit inside a leaf.
        """
        inside: set[int] = set()
        done: set[torch.nn.Module] = set()
        for leaf in module.modules():
            if leaf in done or not z3_leaf_module(leaf):
                continue
            units: list[UnitState] = []
            for sub in leaf.modules():
                done.add(sub)
                for st in self.module_units.pop(sub, []):
                    if st not in units:
                        units.append(st)
            for p in leaf.parameters():
                p.ds_z3_leaf_module = leaf  # type: ignore[attr-defined]
            if units:
                self.module_units[leaf] = units
                inside.update(id(st.unit) for st in units)
            log.info("ZeRO stage 3: %r (%s) is a leaf module: %d unit(s) gathered together",
                     self.module_names.get(leaf, "?"), type(leaf).__name__, len(units))
        return inside

    @torch.no_grad()
    def _make_units(
        self, mod: torch.nn.Module, params: list[torch.nn.Parameter], key_of: dict[int, int], owner: dict[int, UnitState]
    ) -> torch.device:
        # full values of this module's parameters (gathering those built under zero.Init)
        init_units = []
        for p in params:
            u = unit_of(p)
            if u is not None and u not in init_units:
                init_units.append(u)
        for u in init_units:
            u.gather()
        values = [p.detach().to(self.compute_dtype).clone() for p in params]
        device = params[0].device
        for u in init_units:
            u.release()
        by_key: dict[tuple[int, int], tuple[int, Any, list[int]]] = {}
        for i, p in enumerate(params):
            key = key_of.get(id(p), FROZEN)
            comm = self.group_comms[key] if key != FROZEN else expert_comm(self.comm, p, self._mesh)
            by_key.setdefault((key, id(comm)), (key, comm, []))[2].append(i)
        for key, comm, idx in by_key.values():
            ps = [params[i] for i in idx]
            for p in ps:
                if hasattr(p, "ds_shape"):
                    del p.ds_shape
            unit = Stage3Unit(ps, comm, dtype=self.compute_dtype, device=device, name=f"{type(mod).__name__}:{key}")
            unit.load_full([values[i] for i in idx])
            unit.persistent = unit.numel <= self.persistence_threshold
            quantize = self.quantize_weights or (self.quantize_frozen and key == FROZEN)
            if not unit.persistent and quantize and self.qwz is not None:
                # persistent units are gathered once per step: kept exact. qwZ's blocks split this rank's
                # chunk evenly (no padding beyond a few elements)
                strategy = self.qwz(unit)
                unit.gather_strategy = strategy
                unit.quantize_block = strategy.block
            if self.hpz is not None and not unit.persistent and unit.comm is self.comm:
                for sec in self.hpz.attach([unit], store=torch.device("cpu") if self.offload_param else None):
                    sec.keep_initial()  # kept from the first partitioning
            if not unit.persistent:
                unit.release()
            st = UnitState(unit, key, len(self.units))
            self.units.append(st)
            self.by_unit[id(unit)] = st
            for p in ps:
                owner[id(p)] = st
        return device

    @torch.no_grad()
    def _consolidate(self) -> None:
        """Move each unit's partition into one flat tensor per group; build masters and layouts."""
        keys = list(range(len(self.group_params))) + [FROZEN]
        self.parts: dict[int, torch.Tensor] = {}
        self.layouts: list[GroupLayout] = [GroupLayout() for _ in self.group_params]
        self.masters: list[torch.nn.Parameter | None] = [None] * len(self.group_params)
        self.master_grads: list[torch.Tensor] = [torch.zeros(0) for _ in self.group_params]
        for key in keys:
            members = [s for s in self.units if s.key == key]
            if not members:
                continue
            total = sum(s.unit.chunk for s in members)
            part = (
                host_tensor(total, self.compute_dtype, self.pin_param, self.ctx.accelerator)
                if self.offload_param
                else torch.zeros(total, dtype=self.compute_dtype, device=self.device)
            )
            off = 0
            layout = self.layouts[key] if key != FROZEN else GroupLayout()
            for s in members:
                u = s.unit
                part[off : off + u.chunk].copy_(u.partition)
                u.partition = part[off : off + u.chunk]
                s.part_offset = off
                layout.segments.append(
                    Segment(
                        part_offset=off,
                        chunk=u.chunk,
                        names=[self.names.get(id(p), f"param_{id(p)}") for p in u.params],
                        offsets=list(u.offsets),
                        numels=list(u.numels),
                        shapes=list(u.shapes),
                    )
                )
                off += u.chunk
            layout.numel = total
            self.parts[key] = part
            if key == FROZEN:
                continue
            shared = (
                not self.offload_opt and not self.nvme_param and self.compute_dtype == torch.float32
                and part.device == self.device
            )
            if shared:
                master = part
            elif self.offload_opt:
                master = host_tensor(total, torch.float32, self.pin_opt, self.ctx.accelerator)
                master.copy_(part)
            else:
                master = part.to(device=self.device, dtype=torch.float32).clone()
            mgrad = host_tensor(total, torch.float32, self.pin_opt, self.ctx.accelerator) if self.offload_opt else torch.zeros(
                total, dtype=torch.float32, device=master.device
            )
            mp = torch.nn.Parameter(master, requires_grad=True)
            mp.grad = mgrad
            self.masters[key] = mp
            self.master_grads[key] = mgrad
            if not shared:
                for s in members:
                    s.unit.on_modified.append(self._refresh_master_from)

    def _partition_target(self, key: int) -> Any:
        """Where group ``key``'s updated values go: its flat partition, or with parameters on NVMe a
        ``write(start, values)`` over its units' swap files."""
        if self._pswap is None:
            return self.parts[key]
        members = [s for s in self.units if s.key == key]
        units, offsets = [s.unit for s in members], [s.part_offset for s in members]
        return lambda start, values: self._pswap.write_range(units, offsets, start, values)  # type: ignore[union-attr]

    def _partition_values(self, key: int) -> torch.Tensor:
        """Group ``key``'s partition (with parameters on NVMe: read back unit by unit, a copy)."""
        if self._pswap is None:
            return self.parts[key]
        return torch.cat([self._pswap.read(s.unit) for s in self.units if s.key == key])

    def _refresh_master_from(self, unit: FlatUnit) -> None:
        s = self.by_unit[id(unit)]
        m = self.masters[s.key]
        if m is not None:
            nvme_write_master(self._optimizer, m, s.part_offset, unit.partition)  # in swap under NVMe offload

    @torch.no_grad()
    def _masters_to_partitions(self) -> None:
        if self.hpz is not None:  # trainable partitions change: their hpZ copies are stale (frozen ones keep)
            self.hpz.invalidate(s.unit for s in self.units if s.trainable)
        for key, m in enumerate(self.masters):
            # an empty master is on NVMe: its step already wrote the partition
            if m is None or not m.numel():
                continue
            target = self._partition_target(key)
            if not isinstance(target, torch.Tensor):
                target(0, m.data)
            elif m.data.data_ptr() != target.data_ptr():
                target.copy_(m.data)
        persistent = [s.unit for s in self.units if s.unit.persistent]
        for u in persistent:
            u.refresh(async_op=True)
        for u in persistent:
            u.wait()

    def _partitions_to_masters(self) -> None:
        for key, m in enumerate(self.masters):
            if m is not None and (key not in self.parts or m.data.data_ptr() != self.parts[key].data_ptr()):
                m.data.copy_(self._partition_values(key))
