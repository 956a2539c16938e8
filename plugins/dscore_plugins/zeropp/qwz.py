"""ZeRO++ quantized weights ("qwZ", ``zero_optimization.zero_quantized_weights`` and
``zero_quantized_nontrainable_weights``): a stage-3 unit's training gathers send int8 blocks.

Wang et al. 2023, "ZeRO++: Extremely Efficient Collective Communication for Giant Model Training", §3.1.
:class:`QuantizedGather` is a :class:`dscore.zero.partition.GatherStrategy`: a gather that may be
approximate (``FlatUnit.gather(exact=False)``: the stage's forward and backward hooks) quantizes this rank's
partition to int8 blocks of ``block`` elements with one fp32 scale each
(:func:`dscore_plugins.zeropp.quantize.quantize_int8_blockwise`), all-gathers blocks and scales, and
dequantizes every rank's chunk into ``full`` when waited. An exact gather (checkpoints, user gathers, the
re-gather after a step) is the plain all-gather. The partition, the optimizer and the checkpoints stay exact.

**Blocks.** :func:`build` picks, per unit, blocks of at most :data:`DEFAULT_BLOCK` elements that split the
rank's chunk evenly (``ceil(chunk / ceil(chunk / DEFAULT_BLOCK))``: no padding beyond a few elements).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dscore.comm import Work
from dscore.zero.partition import ALL_GATHER, FlatUnit
from dscore_plugins.zeropp.quantize import DEFAULT_BLOCK, dequantize_int8_blockwise, quantize_int8_blockwise

__all__ = ["QuantizedGather", "block_for", "build"]


def block_for(chunk: int, max_block: int = DEFAULT_BLOCK) -> int:
    """Elements per int8 block for a unit of ``chunk`` elements per rank: at most ``max_block``, splitting
    ``chunk`` into equal blocks (the last one padded by at most a few elements)."""
    blocks = -(-chunk // max_block)
    return -(-chunk // blocks)


class QuantizedGather:
    """The qwZ gather strategy of one unit (see the module docstring).

    Args:
        block: elements per int8 block (one fp32 scale each); ``> 0``.

    Raises:
        ValueError: ``block < 1``.
    """

    def __init__(self, block: int) -> None:
        if block < 1:
            raise ValueError(f"qwZ block must be at least 1 element, got {block}")
        self.block = int(block)

    def launch(self, unit: FlatUnit, *, exact: bool) -> tuple[Work | None, bool]:
        """Exact: the plain all-gather. Otherwise the int8 gather (:meth:`launch_quantized`); not exact."""
        if exact:
            return ALL_GATHER.launch(unit, exact=True)
        return self.launch_quantized(unit), False

    def invalidate(self, unit: FlatUnit) -> None:
        """Nothing is kept between gathers (hpZ keeps the int8 blocks: :mod:`dscore_plugins.zeropp.hpz`)."""
        return None

    def launch_quantized(
        self, unit: FlatUnit, on_gathered: Callable[[torch.Tensor, torch.Tensor], None] | None = None
    ) -> Work:
        """All-gather int8 blocks and scales of :meth:`FlatUnit.source`; waiting the work dequantizes into
        ``unit.full`` and then calls ``on_gathered(q_all, s_all)`` (int8 ``[world · blocks · block]``, fp32
        ``[world · blocks]``, every rank's chunk in rank order) when given."""
        src = unit.source()
        world, device = unit.world, unit.full.device
        q, scales = quantize_int8_blockwise(src, self.block)
        q_all = torch.empty(world * q.numel(), dtype=torch.int8, device=device)
        s_all = torch.empty(world * scales.numel(), dtype=torch.float32, device=device)
        works = [
            unit.comm.all_gather_into_tensor(q_all, q, async_op=True),
            unit.comm.all_gather_into_tensor(s_all, scales, async_op=True),
        ]

        def finish() -> None:
            self.dequantize_into(unit, q_all, s_all)
            if on_gathered is not None:
                on_gathered(q_all, s_all)

        return Work(works, finish)

    def dequantize_into(self, unit: FlatUnit, q_all: torch.Tensor, s_all: torch.Tensor) -> None:
        """Write a quantized gather into ``unit.full``: ``q_all`` int8 ``[world · blocks · block]`` and
        ``s_all`` fp32 ``[world · blocks]``, every rank's chunk in rank order."""
        chunk, full = unit.chunk, unit.full
        for r, (qr, sr) in enumerate(zip(q_all.chunk(unit.world), s_all.chunk(unit.world))):
            dequantize_int8_blockwise(qr, sr, full[r * chunk : (r + 1) * chunk], self.block)

    def __repr__(self) -> str:
        return f"QuantizedGather(block={self.block})"


def build(unit: FlatUnit) -> QuantizedGather:
    """The qwZ strategy for ``unit`` (blocks from :func:`block_for` of its chunk); the stage sets it as
    ``unit.gather_strategy``."""
    return QuantizedGather(block_for(unit.chunk))
