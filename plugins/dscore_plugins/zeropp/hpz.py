"""ZeRO++ hierarchical partitioning (hpZ): secondary parameter partitions gathered inside a smaller group.

Wang et al. 2023, "ZeRO++: Extremely Efficient Collective Communication for Giant Model Training", §3.2;
DeepSpeed 0.19.8 behaviour (``zero_optimization.zero_hpz_partition_size``, ``ds_secondary_tensor``,
``_partition_param_sec``, ``invalidate_secondary_tensor``), facts only.

ZeRO stage 3 stores each :class:`~dscore.zero.partition.FlatUnit` as ``world`` equal chunks (the
*primary* partition) and all-gathers them over the whole data-parallel group before each use. With
``zero_hpz_partition_size = h`` (``1 < h``, dividing ``world``) the group is cut into blocks of ``h``
contiguous ranks (:meth:`dscore.parallel.mesh.MeshShape.zero_param_ranks`: ``{0..h-1}, {h..2h-1}, ...``,
one node each when ``h`` is the GPUs per node). When a unit has been gathered over the whole group, rank
``j`` of its block keeps piece ``j`` of the ``h`` equal pieces of the gathered flat buffer: its *secondary
partition* (``padded / h`` elements; also right after the unit is built, from the full values every rank
holds then, as DeepSpeed's first partitioning does). Until the unit's values change, later gathers of the unit (the
backward re-gathers, the forwards of further micro steps) all-gather the secondary partitions inside the
block only: on a cluster, over the fast intra-node links. Gradients are still reduce-scattered over the
whole group and the optimizer still steps the primary partitions; after an optimizer step (and whenever a
unit's partition is written: ``write_back``, ``load_full``, ``refresh``) the secondary partitions of the
changed units are dropped and the next gather goes over the whole group again (and keeps new ones).
Frozen units keep theirs across steps (their values do not change), as DeepSpeed does.

**Bit-identical to ZeRO-3.** A secondary partition is a copy of what the group's gather produced, so a
gather from it gives the same bits as a gather over the whole group. With ZeRO++ quantized weights
(``zero_quantized_weights``) the secondary partition keeps the *int8 blocks and fp32 scales* the
quantized gather received (the unit's own block layout), not the dequantized values: the backward gather
sends int8 inside the block and dequantizes exactly as the forward did. DeepSpeed instead re-quantizes
the dequantized secondary tensor in new blocks (a second rounding error, and 2 bytes per element kept);
dscore's values equal quantized ZeRO-3's bit for bit and the kept copy is ~0.5x of DeepSpeed's in bf16.

**Memory.** Each non-persistent unit keeps ``padded / h`` elements (int8 plus one fp32 scale per block
when quantized) per rank, except between an optimizer step and its next gather, on the device of the unit's primary
partition (the host under ``offload_param: cpu``, copied to the device for each gather).
``engine.empty_partition_cache()`` drops them too. Persistent units (``stage3_param_persistence_threshold``)
stay gathered and keep none.

The stage-3 plugin builds a :class:`HierarchicalPartitioning` (:func:`build_hierarchical_partitioning`,
resolved through the registry as the ``zero_feature:hpz`` unit) and attaches it to its units: each unit's
:class:`SecondaryPartition` becomes its :class:`~dscore.zero.partition.GatherStrategy`, wrapping the
strategy it had (the plain all-gather, or qwZ's :class:`~dscore_plugins.zeropp.qwz.QuantizedGather`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

from dscore.comm import Comm, Work
from dscore.errors import ConfigError
from dscore.zero.partition import FlatUnit, GatherStrategy
from dscore_plugins.zeropp.quantize import quantize_int8_blockwise
from dscore_plugins.zeropp.qwz import QuantizedGather

__all__ = ["HierarchicalPartitioning", "SecondaryPartition", "build_hierarchical_partitioning"]

log = logging.getLogger("dscore.zero.hpz")

_KEY = "zero_optimization.zero_hpz_partition_size"


class SecondaryPartition:
    """One unit's secondary partition: piece ``index`` of ``size`` of its last full gather, and the unit's
    :class:`~dscore.zero.partition.GatherStrategy` while attached.

    Holds either the exact values (``padded / size`` elements of the unit's dtype) or, after a ZeRO++
    quantized gather, this piece of the int8 blocks and of the fp32 block scales every rank sent.

    Args:
        unit: the unit (its ``comm`` is the primary group; ``unit.rank % size`` must be ``comm.rank``).
        comm: the hpZ group (``size`` ranks, ordered like the unit's ranks inside the block).
        store: the device the kept copy lives on (the unit's primary partition's device).
        inner: the strategy of the gathers over the whole group (the unit's strategy before hpZ): the plain
            all-gather, or a :class:`~dscore_plugins.zeropp.qwz.QuantizedGather` whose int8 gathers are
            kept quantized.
    """

    __slots__ = ("unit", "comm", "inner", "size", "index", "store", "exact", "q", "scales")

    def __init__(self, unit: FlatUnit, comm: Comm, store: torch.device, inner: GatherStrategy) -> None:
        self.unit = unit
        self.comm = comm
        self.inner = inner
        self.size = int(comm.world_size)
        self.index = int(comm.rank)
        self.store = store
        self.exact: torch.Tensor | None = None
        self.q: torch.Tensor | None = None
        self.scales: torch.Tensor | None = None

    @property
    def kind(self) -> str | None:
        """``"exact"``, ``"quantized"`` or None (nothing kept)."""
        return "exact" if self.exact is not None else "quantized" if self.q is not None else None

    def nbytes(self) -> int:
        """Bytes kept on this rank."""
        return sum(t.numel() * t.element_size() for t in (self.exact, self.q, self.scales) if t is not None)

    def drop(self) -> None:
        """Forget the kept copy (the unit's values changed, or memory is being freed)."""
        self.exact = self.q = self.scales = None

    @property
    def quantizer(self) -> QuantizedGather | None:
        """The qwZ strategy of the unit's training gathers, or None when they are exact."""
        return self.inner if isinstance(self.inner, QuantizedGather) else None

    # ------------------------------------------------------------------ GatherStrategy
    def launch(self, unit: FlatUnit, *, exact: bool) -> tuple[Work | None, bool]:
        """Gather inside the block from the kept copy when it is of the kind asked for (quantized for a
        training gather of a qwZ unit, exact otherwise); else over the whole group through :attr:`inner`,
        keeping this rank's piece of what arrives."""
        qw = self.quantizer
        quantized = not exact and qw is not None
        work = self.launch_kept(quantized)
        if work is not None:
            return work, not quantized
        if quantized:
            assert qw is not None
            return qw.launch_quantized(unit, on_gathered=self.keep_quantized), False
        work, got_exact = self.inner.launch(unit, exact=True)
        return Work([work], self.keep_exact), got_exact

    def invalidate(self, unit: FlatUnit) -> None:
        """The unit's partition changed: the kept copy is stale."""
        self.drop()

    def _piece(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.view(-1).chunk(self.size)[self.index].to(self.store, copy=True)

    def keep_exact(self) -> None:
        """Keep this rank's piece of the unit's just-gathered exact ``full`` buffer."""
        self.drop()
        self.exact = self._piece(self.unit.full)

    def keep_quantized(self, q_all: torch.Tensor, s_all: torch.Tensor) -> None:
        """Keep this rank's piece of a quantized gather's int8 blocks ``q_all`` and scales ``s_all`` (every
        rank's, in rank order: the pieces are whole ranks' blocks because ``size`` divides the world)."""
        self.drop()
        self.q = self._piece(q_all)
        self.scales = self._piece(s_all)

    def keep_initial(self) -> None:
        """Keep this rank's piece right after the unit was built, while every rank holds its full values
        (DeepSpeed keeps secondary tensors from the first partitioning, so the first forward already gathers
        inside the block). A unit whose training gathers are quantized keeps the int8 blocks and scales of
        each rank's chunk in its piece, computed here as that rank's gather would (same values, same code:
        the same bits)."""
        unit = self.unit
        qw = self.quantizer
        if qw is None:
            self.keep_exact()
            return
        block = qw.block
        per, chunk = unit.world // self.size, unit.chunk
        pieces = [quantize_int8_blockwise(unit.full[r * chunk : (r + 1) * chunk], block)
                  for r in range(self.index * per, (self.index + 1) * per)]  # fmt: skip
        self.drop()
        self.q = torch.cat([q for q, _ in pieces]).to(self.store)
        self.scales = torch.cat([s for _, s in pieces]).to(self.store)

    def launch_kept(self, quantized: bool) -> Work | None:
        """Start the unit's gather from the secondary partitions of its block, or return None when the
        kept copy is not of the requested kind (the unit then gathers over the whole group).

        Args:
            quantized: the gather is a ZeRO++ quantized one (int8 blocks and scales are kept).
        """
        unit = self.unit
        device = unit.full.device
        if not quantized and self.exact is not None:
            src = self.exact.to(device, non_blocking=True)
            work = self.comm.all_gather_into_tensor(unit.full, src, async_op=True)
            return Work([work])
        if quantized and self.q is not None and self.scales is not None:
            q = self.q.to(device, non_blocking=True)
            s = self.scales.to(device, non_blocking=True)
            q_all = torch.empty(self.size * q.numel(), dtype=torch.int8, device=device)
            s_all = torch.empty(self.size * s.numel(), dtype=torch.float32, device=device)
            works = [
                self.comm.all_gather_into_tensor(q_all, q, async_op=True),
                self.comm.all_gather_into_tensor(s_all, s, async_op=True),
            ]
            qw = self.quantizer
            assert qw is not None  # int8 blocks are kept only from a qwZ gather
            return Work(works, lambda: qw.dequantize_into(unit, q_all, s_all))
        return None


class HierarchicalPartitioning:
    """The hpZ state of one ZeRO stage-3 engine: its group and the secondary partitions of its units.

    Args:
        comm: this rank's hpZ group (``size`` contiguous ranks of the primary group, in rank order).
        primary: the group the units are partitioned over (the stage's comm).

    Raises:
        ConfigError: the hpZ group is not a block of contiguous ranks of ``primary`` in rank order.
    """

    def __init__(self, comm: Comm, primary: Comm) -> None:
        self.comm = comm
        self.size = int(comm.world_size)
        self.world = int(primary.world_size)
        if self.world % self.size or primary.rank % self.size != comm.rank:
            raise ConfigError(
                f"{_KEY} {self.size}: the hpZ group does not hold ranks {primary.rank - primary.rank % self.size}.."
                f"{primary.rank - primary.rank % self.size + self.size - 1} of the {self.world}-rank ZeRO group in "
                f"order (rank {primary.rank} is number {comm.rank} in it)",
                path=_KEY,
            )
        self.secondaries: list[SecondaryPartition] = []
        self._of: dict[int, SecondaryPartition] = {}

    def attach(self, units: Iterable[FlatUnit], store: torch.device | None = None) -> list[SecondaryPartition]:
        """Give each unit a :class:`SecondaryPartition`, which becomes its gather strategy (wrapping the
        one it had: set a unit's qwZ strategy before attaching).

        Args:
            store: where the kept copies live (the host under parameter offload); default: the device of
                the unit's primary partition.

        Returns:
            the new secondary partitions, in ``units`` order (nothing kept yet: see
            :meth:`SecondaryPartition.keep_initial`).

        Raises:
            ValueError: a unit is partitioned over another group than the primary one.
        """
        out = []
        for u in units:
            if u.world != self.world:
                raise ValueError(f"unit {u.name!r} is partitioned over {u.world} ranks, hpZ's group over {self.world}")
            sec = SecondaryPartition(u, self.comm, store if store is not None else u.partition.device, u.gather_strategy)
            u.gather_strategy = sec
            self.secondaries.append(sec)
            self._of[id(u)] = sec
            out.append(sec)
        return out

    def invalidate(self, units: Iterable[FlatUnit] | None = None) -> None:
        """Drop the secondary partitions of ``units`` (all when None): their values changed or memory is freed."""
        if units is None:
            for s in self.secondaries:
                s.drop()
            return
        for u in units:
            sec = self._of.get(id(u))
            if sec is not None:
                sec.drop()

    def nbytes(self) -> int:
        """Bytes of secondary partitions kept on this rank."""
        return sum(s.nbytes() for s in self.secondaries)


def build_hierarchical_partitioning(runtime: Any, comm: Comm, size: int) -> HierarchicalPartitioning | None:
    """The hpZ state for a stage partitioning over ``comm`` with ``zero_hpz_partition_size = size``
    (collective on first use: builds the mesh's hpZ groups), or None when ``size <= 1``.

    Args:
        runtime: the engine's :class:`dscore.runtime.runtime.Runtime` (its ``mesh``; a data-parallel mesh
            over ``runtime.comm`` when it has none).
        comm: the group the stage partitions over (must be the mesh's gradient group).

    Raises:
        ConfigError: ``size`` does not divide the group's size (names the key and the valid sizes), or
            the stage's group is not the mesh's gradient group.
    """
    if size <= 1:
        return None
    from dscore.runtime.assembly import mesh_of

    mesh = mesh_of(runtime)
    grad = mesh.grad_comm
    if comm is not grad and (comm.world_size != grad.world_size or comm.rank != grad.rank or comm.group is not grad.group):
        raise ConfigError(
            f"{_KEY} {size}: ZeRO stage 3 partitions over a {comm.world_size}-rank group that is not the parallel "
            f"mesh's data-parallel (gradient) group of {grad.world_size} ranks; hpZ groups are blocks of that group",
            path=_KEY,
        )
    intra = mesh.zero_param_comm(size)
    if intra is None:  # size 1 handled above; keep mypy and a future mesh honest
        return None
    hpz = HierarchicalPartitioning(intra, comm)
    log.info(
        "ZeRO++ hpZ: secondary partitions over %d rank(s) (%s) of %d", size,
        mesh.shape.zero_param_ranks(mesh.rank, size), comm.world_size,
    )
    return hpz
