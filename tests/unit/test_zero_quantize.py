"""Int8 blockwise quantization (ZeRO++ quantized weights): the per-element error bound and the bytes."""

from __future__ import annotations

import torch

from dscore_plugins.zeropp.quantize import dequantize_int8_blockwise, quantize_int8_blockwise, quantized_numel


def test_error_within_half_a_step_of_each_blocks_scale() -> None:
    g = torch.Generator().manual_seed(0)
    block = 256
    # blocks of very different magnitudes, one all-zero block, a length that is not a multiple of the block
    x = torch.cat([torch.randn(block, generator=g) * 10.0**k for k in range(-3, 4)] + [torch.zeros(block)])
    x = torch.cat([x, torch.randn(100, generator=g)])
    for dtype in (torch.float32, torch.bfloat16):
        src = x.to(dtype)
        q, scales = quantize_int8_blockwise(src, block)
        assert q.dtype == torch.int8 and q.numel() == quantized_numel(src.numel(), block)[0]
        assert scales.numel() == -(-src.numel() // block)
        out = torch.empty_like(src)
        dequantize_int8_blockwise(q, scales, out, block)
        ref = src.float()
        err = (out.float() - ref).abs()
        for b in range(scales.numel()):
            part = slice(b * block, min((b + 1) * block, src.numel()))
            bound = ref[part].abs().max()
            assert float(err[part].max()) <= float(bound) / 127  # the documented bound
            # the rounding bound itself: half a step, plus the output dtype's rounding
            slack = float(bound) * (2.0**-8 if dtype == torch.bfloat16 else 1e-6)
            assert float(err[part].max()) <= float(bound) / 254 + slack
        assert torch.equal(out[7 * block : 8 * block], torch.zeros(block, dtype=dtype))  # zero block stays zero
        # bytes on the wire: one byte per element (padded to whole blocks) plus a 4-byte scale per block;
        # for whole blocks of 2048 that is 0.50x of bf16 and 0.25x of fp32 (+0.1%, +0.05%)
        assert q.numel() + 4 * scales.numel() == 9 * block + 4 * 9
        aligned = torch.randn(4 * 2048, generator=g).to(dtype)
        qa, sa = quantize_int8_blockwise(aligned)
        ratio = (qa.numel() + 4 * sa.numel()) / (aligned.numel() * aligned.element_size())
        assert abs(ratio - (0.5 if dtype == torch.bfloat16 else 0.25) * (1 + 4 / 2048)) < 1e-12
