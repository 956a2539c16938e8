"""Plain-PyTorch references for the test-device matrix (one process, the global batch of every micro step).

:func:`reference` trains :func:`testdevice_matrix.make_model` as the engine is configured by :func:`testdevice_matrix.engine_config`:
AdamW (torch), gradient clipping by the global norm, gradient accumulation, and for bf16/fp16 a low-precision
model with fp32 master weights (``master_dtype=torch.bfloat16`` keeps the masters in bf16 instead: the
variant a correct engine must be told apart from). fp16 uses DeepSpeed's ZeRO dynamic loss scaler
(``DynamicLossScaler.update_scale``: overflow halves the scale with hysteresis 1, ``loss_scale_window``
stable steps double it) and skips the step on overflow.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from testdevice_matrix import CLIP, GAS, LR, MICRO, SGD_LR, STEPS, data, make_model


def reference(cell: dict[str, Any], world: int = 2, master_dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Final weights (numpy), applied flags and the loss scale after every step."""
    gas, steps = cell.get("gas", GAS), cell.get("steps", STEPS)
    precision = cell["precision"]
    low = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    model = make_model().to(low)
    masters = [p.detach().clone().to(master_dtype).requires_grad_(True) for p in make_model().parameters()]
    if cell.get("optimizer") == "SGD":
        opt: torch.optim.Optimizer = torch.optim.SGD(masters, lr=SGD_LR)
    else:
        opt = torch.optim.AdamW(masters, lr=LR, weight_decay=0.01)
    scale = 2.0 ** cell.get("scale_power", 8) if precision == "fp16" else 1.0
    window, cur_iter, last_overflow = 2, 0, -1
    x, y = data(MICRO * world * gas * steps)
    if cell.get("spike"):
        x[MICRO * world * gas:MICRO * world * (gas + 1)] *= 1e6
    span = MICRO * world
    applied, scales = [], []
    for s in range(steps):
        used = scale  # the scale this step's backward multiplied by
        acc = [torch.zeros_like(m, dtype=torch.float32) for m in masters]
        for m in range(gas):
            k = s * gas + m
            for r in range(world):  # each rank's micro-batch, its loss averaged over ranks as the engine does
                rows = slice(k * span + r * MICRO, k * span + (r + 1) * MICRO)
                model.zero_grad(set_to_none=True)
                out = model(x[rows].to(low))
                loss = ((out.float() - y[rows]) ** 2).mean()
                (loss * scale / gas).backward()
                for a, p in zip(acc, model.parameters()):
                    a += p.grad.float() / world
        sq = sum(float(a.double().pow(2).sum()) for a in acc)
        norm = math.sqrt(sq) / used
        overflow = precision == "fp16" and not math.isfinite(norm)
        if precision == "fp16":
            if overflow:
                scale = max(scale / 2.0, 1.0)
                last_overflow = cur_iter
            else:
                stable = cur_iter - last_overflow - 1
                if stable > 0 and stable % window == 0:
                    scale *= 2.0
            cur_iter += 1
        applied.append(not overflow)
        if not overflow:
            coef = min(1.0, CLIP / (norm + 1e-6)) if cell.get("clip", True) else 1.0
            for mp, a in zip(masters, acc):
                mp.grad = (a / used * coef).to(master_dtype)
            opt.step()
            with torch.no_grad():
                for p, mp in zip(model.parameters(), masters):
                    p.copy_(mp)
        scales.append(scale if precision == "fp16" else 1.0)
    names = [n for n, _ in make_model().named_parameters()]
    return {
        "params": {n: p.detach().float().numpy().copy() for n, p in zip(names, model.parameters())},
        "masters": {n: m.detach().float().numpy().copy() for n, m in zip(names, masters)},
        "applied": applied,
        "scales": scales,
    }
