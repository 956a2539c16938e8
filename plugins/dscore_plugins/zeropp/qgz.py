"""ZeRO++ quantized gradients ("qgZ", ``zero_optimization.zero_quantized_gradients``): ZeRO-3's gradient
reduce-scatter done as int4 blockwise all-to-alls, intra-node then inter-node.

Source: Wang et al. 2023, "ZeRO++: Extremely Efficient Collective Communication for Giant Model Training",
§3.3; DeepSpeed 0.19.8 ``all_to_all_quant_reduce`` (``deepspeed/runtime/comm/coalesced_collectives.py``)
with its ``swizzle_quant`` / ``quantized_reduction`` kernels (``csrc/quantization``). The algorithm is
restated here on dscore's flat gradient buckets, in PyTorch operations.

**Ranks and nodes.** The ``W`` data-parallel ranks are grouped by node: the node of a rank is its global
rank divided by the number of ranks per node, ``LOCAL_WORLD_SIZE`` (from the launcher: torchrun and
``dscore run`` set it; :attr:`dscore.comm.DistributedEnv.local_world_size`). Every node must hold the same
number ``L`` of data-parallel ranks (``N = W / L`` nodes); the local index of a rank is its position among
its node's ranks. Two sub-groups are built once, with ``Comm.new_group``: the *intra* group (this node's
``L`` ranks) and the *inter* group (the ``N`` ranks with this rank's local index, one per node).

**Algorithm** (rank ``R(n, l)``: node ``n``, local index ``l``; the bucket is ``W`` chunks of ``c``
elements, chunk ``r`` being rank ``r``'s partition):

1. each destination chunk is cut into blocks of at most :data:`QGZ_BLOCK` elements (evenly, even sizes,
   zero-padded), quantized to int4 with an fp32 scale per block (:func:`dscore_plugins.zeropp.quantize.quantize_int4_blockwise`);
2. intra-node all-to-all: local peer ``l'`` receives the chunks of ranks ``R(n', l')`` for every node ``n'``
   (packed nibbles and scales in one uint8 message);
3. each rank dequantizes the ``L`` copies it received and sums them (fp32): partial sums over its node of
   the chunks of ranks ``R(n', l)``; these are quantized again, same blocks;
4. inter-node all-to-all: node ``n'``'s partial of chunk ``R(n', l)`` goes to that rank;
5. dequantize the ``N`` partials and sum (fp32): this rank's chunk of the sum over all ranks.

With one rank per node (``L = 1``) steps 2-3 vanish: one quantized all-to-all over all ranks, then
dequantize and sum. With one node (``N = 1``) DeepSpeed does not quantize (``__avg_scatter_grads`` takes
the exact reduce-scatter when ``num_nodes == 1``) and neither does dscore: :func:`build` returns None and
logs a warning. The sum is a sum (no averaging): the stage's divisors (``gradient_divisors``) apply as in
an exact reduce-scatter.

**Error bound** (per element, fp32 arithmetic aside): step 1 moves each rank's value by at most
``m_i / 14`` (``m_i``: max magnitude of that rank's block holding the element); step 3 moves each node's
partial by at most ``p_n / 14`` (``p_n``: max magnitude of the node's dequantized partial over the block).
So ``|qgZ - exact| <= sum_i m_i / 14 + sum_n p_n / 14``, and since a dequantized value never exceeds its
block's maximum (``|q| <= 7``, scale ``m_i / 7``), ``p_n <= sum_{i in n} m_i``: the result is within
``sum_i m_i / 7`` of the exact sum over two levels, ``sum_i m_i / 14`` over one (``L = 1``).

**Bytes each rank sends** (``E`` elements per bucket): ``(L-1)/L · E/2`` at step 2 plus ``(N-1)/N · E/(2L)``
at step 4, plus 4 bytes of scale per block; an exact reduce-scatter sends ``(W-1)/W · E · element_size``.
The ratio is ``(LN - 1) / (4(W - 1)) = 1/4`` of a 16-bit reduce-scatter (1/8 of fp32) for any ``N`` and
``L``, times ``1 + 8/block`` for the scales (measured against bf16 at ``block`` <= 256: 0.2589× on 2 ranks
as 2 nodes, 0.2591× on 4 ranks as 2 nodes of 2).

**Ordering.** The intra-node exchange and its reduction run when the bucket is launched (blocking); the
inter-node exchange is then launched asynchronously and its :class:`dscore.comm.Work` dequantizes into
the output when waited. So every collective is launched in launch order, never at wait time, and any wait
order is safe, as :class:`dscore.comm.Work` requires.

Scope (ZeRO stage 3, as DeepSpeed): dscore quantizes whole unit buckets (a module's direct parameters,
1-D ones included); DeepSpeed quantizes per parameter and leaves 1-D gradients and those whose size does
not divide by ``2·W`` exact.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dscore.comm import Work
from dscore.errors import ConfigError
from dscore_plugins.zeropp.quantize import dequantize_int4_blockwise, quantize_int4_blockwise

if TYPE_CHECKING:
    from dscore.comm import Comm

__all__ = ["QGZ_BLOCK", "NodeLayout", "QuantizedReduceScatter", "block_geometry", "build", "node_layout"]

log = logging.getLogger("dscore.zero")

#: largest quantization block (elements) of a destination chunk. Scales cost 4/256 bytes per element (+3.1%
#: over the int4 payload); DeepSpeed's groups are about a weight's row (256 elements at hidden size 256).
#: Measured on the 20-step curve of tests/distributed/test_zeropp_quantized_gradients.py, largest relative
#: loss gap to unquantized ZeRO-3: 2.8% at 64, 3.3% at 128, 5.0% at 256, 6.5% at 512, 10.7% at 2048.
QGZ_BLOCK = 256

_KEY = "zero_optimization.zero_quantized_gradients"


@dataclass(frozen=True)
class NodeLayout:
    """Data-parallel ranks grouped by node (see the module docstring).

    Attributes:
        nodes: per node (in global-rank order), its data-parallel ranks in global-rank order.
    """

    nodes: tuple[tuple[int, ...], ...]

    @property
    def num_nodes(self) -> int:
        """``N``: nodes holding data-parallel ranks."""
        return len(self.nodes)

    @property
    def local_size(self) -> int:
        """``L``: data-parallel ranks per node."""
        return len(self.nodes[0])

    def place(self, rank: int) -> tuple[int, int]:
        """``(node index, local index)`` of data-parallel ``rank``."""
        for n, members in enumerate(self.nodes):
            if rank in members:
                return n, members.index(rank)
        raise KeyError(rank)


def node_layout(global_ranks: Sequence[int], local_world_size: int) -> NodeLayout:
    """Group data-parallel ranks by node: data-parallel rank ``r`` has global rank ``global_ranks[r]`` and
    lives on node ``global_ranks[r] // local_world_size``.

    Raises:
        ConfigError: ``local_world_size`` < 1, or the nodes hold different numbers of data-parallel ranks.
    """
    if local_world_size < 1:
        raise ConfigError(
            f"{_KEY}: the number of ranks per node is unknown (LOCAL_WORLD_SIZE = {local_world_size}); qgZ groups "
            "ranks by node: launch with torchrun or `dscore run`, or set LOCAL_WORLD_SIZE",
            path=_KEY,
        )
    by_node: dict[int, list[int]] = {}
    for r, g in sorted(enumerate(global_ranks), key=lambda rg: rg[1]):
        by_node.setdefault(g // local_world_size, []).append(r)
    nodes = tuple(tuple(by_node[k]) for k in sorted(by_node))
    sizes = {len(m) for m in nodes}
    if len(sizes) != 1:
        raise ConfigError(
            f"{_KEY}: the data-parallel ranks are spread unevenly over the nodes (LOCAL_WORLD_SIZE = "
            f"{local_world_size}; ranks per node: {[len(m) for m in nodes]}); the two-level all-to-all needs the "
            "same number on every node",
            path=_KEY,
        )
    return NodeLayout(nodes)


def block_geometry(chunk: int, max_block: int = QGZ_BLOCK) -> tuple[int, int]:
    """``(block, padded chunk)``: a chunk of ``chunk`` elements cut into equal even blocks of at most
    ``max_block`` (rounded up to even) elements, padded up to whole blocks."""
    blocks = max(1, math.ceil(chunk / max_block))
    block = math.ceil(chunk / blocks)
    block += block % 2
    return block, blocks * block


class QuantizedReduceScatter:
    """The qgZ reduce-scatter over a data-parallel :class:`dscore.comm.Comm` (collective: every rank of it
    builds one, in the same order relative to other groups it creates).

    Call it as ``qgz(output, input)``: ``input`` is the padded bucket (``W · c`` elements, any float dtype),
    ``output`` receives this rank's chunk of the sum over ranks (``c`` elements, its own dtype and device);
    returns a :class:`dscore.comm.Work`. This is the shape :class:`dscore.zero.reducer.GradientReducer`
    takes as ``reduce_scatter_fn``.

    Args:
        comm: the data-parallel comm.
        layout: its ranks grouped by node (:func:`node_layout`), at least 2 nodes.
        max_block: largest quantization block.

    Raises:
        ValueError: ``layout`` has a single node or does not cover ``comm``'s ranks.
    """

    def __init__(self, comm: Comm, layout: NodeLayout, *, max_block: int = QGZ_BLOCK) -> None:
        if layout.num_nodes < 2 or sum(len(m) for m in layout.nodes) != comm.world_size:
            raise ValueError(f"qgZ needs >= 2 nodes covering all {comm.world_size} ranks, got {layout.nodes}")
        self.comm = comm
        self.layout = layout
        self.max_block = max_block
        self.world = comm.world_size
        self.rank = comm.rank
        self.node, self.local = layout.place(self.rank)
        n_nodes, local = layout.num_nodes, layout.local_size
        # rows of the level-1 message, in the order the first exchange's peers take them: peer l' gets the
        # chunks of ranks R(n', l') for every node n' (one rank per node: rank r's chunk goes to rank r)
        self.intra: Comm | None = None
        self.inter: Comm = comm  # one rank per node: the one exchange spans every rank
        self._order = list(range(self.world))
        self._order_on: dict[torch.device, torch.Tensor] = {}
        if local > 1:
            self._order = [layout.nodes[n][lp] for lp in range(local) for n in range(n_nodes)]
            self.intra = self._subcomm(layout.nodes[self.node], self.local)
            self.inter = self._subcomm([layout.nodes[n][self.local] for n in range(n_nodes)], self.node)

    def _subcomm(self, ranks: Sequence[int], expect: int) -> Comm:
        comm = self.comm
        globals_ = sorted(comm.global_rank(r) for r in ranks)
        # only the members synchronise: each rank builds its intra group, then its inter group
        sub = comm.bound_to(comm.new_group(globals_, use_local_synchronization=True))
        if sub.rank != expect:
            raise AssertionError(f"qgZ group of global ranks {globals_}: rank {sub.rank}, expected {expect}")
        return sub

    # ------------------------------------------------------------------ wire format
    @staticmethod
    def _pack(rows: torch.Tensor, block: int) -> torch.Tensor:
        """``[k, cp]`` float rows -> ``[k, cp/2 + 4·cp/block]`` uint8 (nibbles, then fp32 scale bytes)."""
        packed, scales = quantize_int4_blockwise(rows, block)
        return torch.cat([packed, scales.contiguous().view(torch.uint8)], dim=-1)

    @staticmethod
    def _unpack(msg: torch.Tensor, cp: int, block: int) -> torch.Tensor:
        """Inverse of :meth:`_pack`: fp32 ``[..., cp]``."""
        half = cp // 2
        scales = msg[..., half:].contiguous().view(torch.float32)
        return dequantize_int4_blockwise(msg[..., :half], scales, block)

    # ------------------------------------------------------------------ the collective
    @torch.no_grad()
    def __call__(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        """Reduce-scatter ``input`` into ``output`` (see the class docstring).

        Raises:
            ValueError: ``input`` is not ``W`` chunks of ``output.numel()`` elements.
        """
        c, w = output.numel(), self.world
        if input.numel() != w * c:
            raise ValueError(f"qgZ reduce-scatter: input of {input.numel()} elements is not {w} chunks of {c}")
        block, cp = block_geometry(c, self.max_block)
        rows = input.reshape(w, c)
        if cp != c:
            padded = torch.zeros(w, cp, dtype=input.dtype, device=input.device)
            padded[:, :c] = rows
            rows = padded
        if self._order != list(range(w)):
            order = self._order_on.get(input.device)
            if order is None:  # built once per device: no host-to-device copy per bucket
                order = self._order_on[input.device] = torch.tensor(self._order, device=input.device)
            rows = rows.index_select(0, order)
        msg = self._pack(rows, block)
        n_nodes, local = self.layout.num_nodes, self.layout.local_size
        if self.intra is not None:
            got = torch.empty_like(msg)
            self.intra.all_to_all_single(got, msg)
            # [L peers, N nodes, cp]: sum the node's contributions to the chunks of ranks R(n', l)
            partial = self._unpack(got.view(local, n_nodes, -1), cp, block).sum(dim=0)
            msg = self._pack(partial, block)
        recv = torch.empty_like(msg)
        work = self.inter.all_to_all_single(recv, msg, async_op=True)

        def finish(_sent: torch.Tensor = msg) -> None:  # the sent message lives until the exchange completed
            total = self._unpack(recv, cp, block).sum(dim=0)
            output.view(-1).copy_(total[:c])

        return Work([work], finish)


def build(comm: Comm, *, local_world_size: int, max_block: int = QGZ_BLOCK) -> QuantizedReduceScatter | None:
    """The qgZ reduce-scatter for the data-parallel ``comm``, or None where DeepSpeed does not quantize
    (a single node, or a single rank), with a warning naming the key (collective over ``comm``).

    Args:
        comm: the data-parallel comm.
        local_world_size: ranks per node on this rank (``LOCAL_WORLD_SIZE``); compared across ranks.

    Raises:
        ConfigError: ranks disagree on ``LOCAL_WORLD_SIZE``, it is unknown, or nodes hold different
            numbers of data-parallel ranks.
    """
    if comm.world_size == 1:
        log.warning("%s: one data-parallel rank, nothing to reduce; the key has no effect", _KEY)
        return None
    seen = comm.all_gather_object(int(local_world_size))
    if len(set(seen)) != 1:
        raise ConfigError(
            f"{_KEY}: the ranks disagree on LOCAL_WORLD_SIZE (by data-parallel rank: {seen}); qgZ groups ranks "
            "by node and needs the same value everywhere",
            path=_KEY,
        )
    layout = node_layout([comm.global_rank(r) for r in range(comm.world_size)], int(local_world_size))
    if layout.num_nodes == 1:
        log.warning(
            "%s: all %d data-parallel ranks are on one node (LOCAL_WORLD_SIZE = %d); as DeepSpeed 0.19.8, the "
            "gradient reduce-scatter stays exact (qgZ quantizes only across nodes)",
            _KEY, comm.world_size, local_world_size,
        )
        return None
    qgz = QuantizedReduceScatter(comm, layout, max_block=max_block)
    log.info(
        "%s: int4 blocks of <= %d elements, %d node(s) x %d rank(s)%s", _KEY, max_block, layout.num_nodes,
        layout.local_size, " (one level: one rank per node)" if layout.local_size == 1 else " (intra- then inter-node)",
    )
    return qgz
