"""Symmetric blockwise quantization for ZeRO++ (Wang et al. 2023, "ZeRO++: Extremely Efficient Collective
Communication for Giant Model Training"): int8 for quantized weights ("qwZ", §3.1) and packed int4 for
quantized gradients ("qgZ", §3.3; :mod:`dscore_plugins.zeropp.qgz`).

**int8** (weights):
A flat tensor is cut into blocks of ``block`` elements (the last one zero-padded); each block ``b`` gets
``scale_b = max|x_b| / 127`` (fp32) and ``q = round(x / scale_b)`` in int8 (``[-127, 127]``; an all-zero
block has scale 0 and quantizes to zeros). Dequantizing multiplies back, so every element is within
``scale_b / 2 = max|x_b| / 254`` of its original value (rounding error, plus the rounding of the result
to the output dtype). On the wire: ``block`` bytes plus 4 bytes of scale per block, against
``block · element_size`` unquantized (≈ 0.50× of bf16/fp16, ≈ 0.25× of fp32 at ``block = 2048``).

**int4** (gradients): rows of ``n`` elements (``n`` a multiple of an even ``block``); each block gets
``scale_b = max|x_b| / 7`` (fp32) and ``q = round(x / scale_b)`` in ``[-7, 7]``, stored as ``q + 8`` in one
nibble, two per byte (element ``2i`` in the low nibble of byte ``i``, ``2i + 1`` in the high one). Every
element dequantizes within ``scale_b / 2 = max|x_b| / 14`` (plus fp32 rounding), inside the
``max|x_b| / 7`` the issue states. DeepSpeed 0.19.8's kernel (``csrc/quantization``, ``Params<Symmetric>``)
uses ``scale = max / 8`` with ``q`` clamped to ``[-8, 7]``, so its block maximum is off by up to
``max / 8``; dscore's symmetric range keeps every element within half a step. A block holding an inf or
NaN gets a non-finite scale, so its whole block dequantizes non-finite: a loss-scale overflow stays visible
to the overflow check after the reduction. On the wire: ``block / 2`` bytes plus 4 bytes of scale per
block (≈ 0.25× of bf16/fp16 and ≈ 0.125× of fp32 per element, +4/``block`` bytes per element for scales).
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "DEFAULT_BLOCK",
    "INT4_MAX",
    "dequantize_int4_blockwise",
    "dequantize_int8_blockwise",
    "quantize_int4_blockwise",
    "quantize_int8_blockwise",
    "quantized_numel",
]

#: elements per quantization block used by ZeRO-3's quantized weight gathers
DEFAULT_BLOCK = 2048


def quantized_numel(numel: int, block: int) -> tuple[int, int]:
    """``(int8 elements, blocks)`` for ``numel`` values: both padded up to whole blocks."""
    blocks = max(1, math.ceil(numel / block))
    return blocks * block, blocks


def quantize_int8_blockwise(x: torch.Tensor, block: int = DEFAULT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the flattened ``x`` (any float dtype, any device).

    Returns:
        ``(q, scales)``: ``q`` int8 of :func:`quantized_numel` elements, ``scales`` fp32 ``[blocks]``, on
        ``x``'s device.
    """
    flat = x.reshape(-1).float()
    n_q, blocks = quantized_numel(flat.numel(), block)
    padded = torch.zeros(n_q, dtype=torch.float32, device=x.device)
    padded[: flat.numel()] = flat
    view = padded.view(blocks, block)
    scales = view.abs().amax(dim=1) / 127.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(view / safe.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
    return q.reshape(-1), scales


def dequantize_int8_blockwise(
    q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, block: int = DEFAULT_BLOCK
) -> None:
    """Write the first ``out.numel()`` dequantized values of ``(q, scales)`` into ``out`` (its dtype).

    Shapes: ``q`` ``[blocks · block]`` int8, ``scales`` ``[blocks]`` fp32, ``out`` contiguous.
    """
    values = (q.view(-1, block).float() * scales.unsqueeze(1)).reshape(-1)
    out.view(-1).copy_(values[: out.numel()])


#: largest int4 magnitude used (symmetric range ``[-7, 7]``)
INT4_MAX = 7


def _check_int4_rows(n: int, block: int) -> None:
    if block <= 0 or block % 2 or n % block:
        raise ValueError(f"int4 blocks must be even and divide the row length: block {block}, row {n} elements")


def quantize_int4_blockwise(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the rows of ``x`` to packed int4 with one fp32 scale per block (see the module docstring).

    Args:
        x: ``[..., n]`` floating tensor (any float dtype, any device), ``n`` a multiple of ``block``.
        block: elements per block (even).

    Returns:
        ``(packed, scales)`` on ``x``'s device: ``packed`` uint8 ``[..., n // 2]`` (two values per byte),
        ``scales`` fp32 ``[..., n // block]`` (``max|block| / 7``; 0 for an all-zero block, non-finite for
        a block holding an inf or NaN).

    Raises:
        ValueError: ``block`` is odd or does not divide ``n``.
    """
    n = x.shape[-1]
    _check_int4_rows(n, block)
    lead = x.shape[:-1]
    view = x.reshape(-1, n // block, block).float()
    scales = view.abs().amax(dim=-1) / INT4_MAX
    safe = torch.where(torch.isfinite(scales) & (scales > 0), scales, torch.ones_like(scales))
    q = torch.round(view / safe.unsqueeze(-1)).nan_to_num_(0.0, 0.0, 0.0).clamp_(-INT4_MAX, INT4_MAX)
    nib = (q + 8).to(torch.uint8).reshape(-1, n)
    packed = nib[:, 0::2] | (nib[:, 1::2] << 4)
    return packed.reshape(*lead, n // 2), scales.reshape(*lead, n // block)


def dequantize_int4_blockwise(packed: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """Inverse of :func:`quantize_int4_blockwise`: fp32 ``[..., n]`` from ``packed`` uint8 ``[..., n // 2]``
    and ``scales`` fp32 ``[..., n // block]`` (a non-finite scale makes its whole block non-finite).

    Raises:
        ValueError: the shapes do not fit ``block``.
    """
    n = packed.shape[-1] * 2
    _check_int4_rows(n, block)
    if scales.shape[-1] * block != n or scales.shape[:-1] != packed.shape[:-1]:
        raise ValueError(f"int4 scales {tuple(scales.shape)} do not fit packed data {tuple(packed.shape)} at block {block}")
    lead = packed.shape[:-1]
    flat = packed.reshape(-1, n // 2)
    q = torch.empty(flat.shape[0], n, dtype=torch.float32, device=packed.device)
    q[:, 0::2] = (flat & 0x0F).float()
    q[:, 1::2] = (flat >> 4).float()
    q.sub_(8.0)
    s = scales.reshape(-1, n // block, 1).float()
    # 0 * inf is NaN: a non-finite scale poisons its whole block, as it should (overflow detection)
    out = (q.view(-1, n // block, block) * s).reshape(*lead, n)
    return out
