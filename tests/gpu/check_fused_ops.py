"""Standalone GPU check of the fused CUDA optimizers (run on a machine with a CUDA device).

Builds fused_adam, fused_lamb and fused_lion with ninja/nvcc (JIT, into ``TORCH_EXTENSIONS_DIR``), then
compares each against a plain-torch reference on CUDA over many steps, for fp32 params and for
bf16/fp16 params (fp32 states), including tensors larger than one multi-tensor launch. Prints one
``PASS``/``FAIL`` line per check and exits 1 if any failed, 2 if no CUDA device is present.

    TORCH_CUDA_ARCH_LIST unset -> the visible device's capability is used.
    python tests/gpu/check_fused_ops.py [--steps 50] [--bench]

``--bench`` also times FusedAdam against ``torch.optim.AdamW(fused=True)`` on 50M fp32 params.
References: Adam — Kingma & Ba 2015; AdamW — Loshchilov & Hutter 2019; LAMB — You et al. 2020;
Lion — Chen et al. 2023.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Callable

import torch

# shapes: many small tensors (several tensors per launch), one odd size, one spanning >320 chunks of 65536
SHAPES = [(3,), (1,), (4097,), (128, 257)] * 12 + [(21_000_001,)]


def _make(dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(s, generator=gen, device="cuda").to(dtype) for s in SHAPES]


def _grads(params: list[torch.Tensor], gen: torch.Generator) -> list[torch.Tensor]:
    return [torch.randn(p.shape, generator=gen, device="cuda").to(p.dtype) for p in params]


class RefLamb(torch.optim.Optimizer):
    """LAMB in plain torch, fp32 math: trust ratio ||p||/||u|| clamped to [min_coeff, max_coeff]."""

    def __init__(self, params, lr, betas, eps, weight_decay, max_coeff, min_coeff):  # type: ignore[no-untyped-def]
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, max_coeff=max_coeff,
                                      min_coeff=min_coeff))

    @torch.no_grad()
    def step(self):  # type: ignore[no-untyped-def]
        for g in self.param_groups:
            b1, b2 = g["betas"]
            for p in g["params"]:
                st = self.state[p]
                if not st:
                    st["t"] = 0
                    st["m"] = torch.zeros_like(p, dtype=torch.float32)
                    st["v"] = torch.zeros_like(p, dtype=torch.float32)
                st["t"] += 1
                grad, p32 = p.grad.float(), p.float()
                st["m"].mul_(b1).add_(grad, alpha=1 - b1)
                st["v"].mul_(b2).addcmul_(grad, grad, value=1 - b2)
                u = (st["m"] / (1 - b1 ** st["t"])) / ((st["v"] / (1 - b2 ** st["t"])).sqrt() + g["eps"])
                u = u + g["weight_decay"] * p32
                pn, un = p32.norm(), u.norm()
                ratio = (pn / un) if (pn > 0 and un > 0) else torch.tensor(1.0, device=p.device)
                ratio = ratio.clamp(g["min_coeff"], g["max_coeff"])
                p.copy_((p32 - g["lr"] * ratio * u).to(p.dtype))


class RefLion(torch.optim.Optimizer):
    """Lion in plain torch, fp32 math."""

    def __init__(self, params, lr, betas, weight_decay):  # type: ignore[no-untyped-def]
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):  # type: ignore[no-untyped-def]
        for g in self.param_groups:
            b1, b2 = g["betas"]
            for p in g["params"]:
                m = self.state[p].setdefault("m", torch.zeros_like(p, dtype=torch.float32))
                grad, p32 = p.grad.float(), p.float()
                c = m * b1 + grad * (1 - b1)
                p.copy_((p32 * (1 - g["lr"] * g["weight_decay"]) - g["lr"] * torch.sign(c)).to(p.dtype))
                m.mul_(b2).add_(grad * (1 - b2))


class RefAdamLowPrecision(torch.optim.Optimizer):
    """AdamW with fp32 states and math over fp16/bf16 params (what FusedAdam does for them)."""

    def __init__(self, params, lr, betas, eps, weight_decay):  # type: ignore[no-untyped-def]
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):  # type: ignore[no-untyped-def]
        for g in self.param_groups:
            b1, b2 = g["betas"]
            for p in g["params"]:
                st = self.state[p]
                if not st:
                    st["t"], st["m"], st["v"] = 0, torch.zeros_like(p, dtype=torch.float32), torch.zeros_like(
                        p, dtype=torch.float32)
                st["t"] += 1
                grad, p32 = p.grad.float(), p.float() * (1 - g["lr"] * g["weight_decay"])
                st["m"].lerp_(grad, 1 - b1)
                st["v"].mul_(b2).addcmul_(grad, grad, value=1 - b2)
                denom = st["v"].sqrt() / (1 - b2 ** st["t"]) ** 0.5 + g["eps"]
                p.copy_((p32 - g["lr"] / (1 - b1 ** st["t"]) * st["m"] / denom).to(p.dtype))


def _compare(name: str, make_ours: Callable, make_ref: Callable, dtype: torch.dtype, steps: int,
             rtol: float, atol: float) -> bool:
    base = _make(dtype, 0)
    ours_p = [p.clone() for p in base]
    ref_p = [p.clone() for p in base]
    ours, ref = make_ours(ours_p), make_ref(ref_p)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(steps):
        for a, b, g in zip(ours_p, ref_p, _grads(base, gen)):
            a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    torch.cuda.synchronize()
    worst = 0.0
    ok = True
    for a, b in zip(ours_p, ref_p):
        diff = (a.float() - b.float()).abs()
        tol = atol + rtol * b.float().abs()
        if bool((diff > tol).any()):
            ok = False
        worst = max(worst, float(diff.max()))
    print(f"{'PASS' if ok else 'FAIL'} {name} [{str(dtype).replace('torch.', '')}] {steps} steps, max |diff| {worst:.3g}")
    return ok


def _lamb_deterministic(steps: int = 5) -> bool:
    """FusedLamb twice from the same state: the per-tensor norms are summed in a fixed order (issue 28,
    no float atomicAdd), so both runs must give the same bits."""
    from dscore_plugins.ops.fused_optim import FusedLamb

    runs = []
    for _ in range(2):
        params = _make(torch.float32, 0)
        opt = FusedLamb(params, lr=1e-3, weight_decay=0.01)
        gen = torch.Generator(device="cuda").manual_seed(1)
        for _ in range(steps):
            for p, g in zip(params, _grads(params, gen)):
                p.grad = g
            opt.step()
        torch.cuda.synchronize()
        runs.append(params)
    same = all(torch.equal(a, b) for a, b in zip(*runs))
    print(f"{'PASS' if same else 'FAIL'} FusedLamb deterministic [float32] {steps} steps, two runs bit-identical: {same}")
    return same


def _bench() -> None:
    from dscore_plugins.ops.fused_optim import FusedAdam

    params = [torch.randn(50_000_000 // 8, device="cuda") for _ in range(8)]
    ref_params = [p.clone() for p in params]
    for p, q in zip(params, ref_params):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    ours, ref = FusedAdam(params, lr=1e-4), torch.optim.AdamW(ref_params, lr=1e-4, fused=True)
    for name, opt in (("dscore FusedAdam", ours), ("torch AdamW fused", ref)) * 2:
        for _ in range(3):
            opt.step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            opt.step()
        torch.cuda.synchronize()
        dt = (time.perf_counter() - start) / 20
        print(f"BENCH {name}: {dt * 1e3:.3f} ms/step, {28 * 50e6 / dt / 1e9:.0f} GB/s effective")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--bench", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("FAIL no CUDA device visible; run this on a GPU machine")
        return 2
    from dscore_plugins.ops.fused_optim import FusedAdam, FusedLamb, FusedLion

    results: list[bool] = []
    checks = [
        ("FusedAdam(adamw) vs torch.optim.AdamW", torch.float32,
         lambda p: FusedAdam(p, lr=1e-3, weight_decay=0.01), lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01),
         1e-5, 1e-6),
        ("FusedAdam(adam L2) vs torch.optim.Adam", torch.float32,
         lambda p: FusedAdam(p, lr=1e-3, weight_decay=0.01, adam_w_mode=False),
         lambda p: torch.optim.Adam(p, lr=1e-3, weight_decay=0.01), 1e-5, 1e-6),
        ("FusedAdam(adamw) vs fp32-math reference", torch.bfloat16,
         lambda p: FusedAdam(p, lr=1e-3, weight_decay=0.01),
         lambda p: RefAdamLowPrecision(p, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01), 1e-2, 1e-2),
        ("FusedAdam(adamw) vs fp32-math reference", torch.float16,
         lambda p: FusedAdam(p, lr=1e-3, weight_decay=0.01),
         lambda p: RefAdamLowPrecision(p, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01), 1e-3, 1e-3),
        ("FusedLamb vs reference LAMB", torch.float32,
         lambda p: FusedLamb(p, lr=1e-3, weight_decay=0.01),
         lambda p: RefLamb(p, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, max_coeff=10.0,
                           min_coeff=0.01), 1e-4, 1e-5),
        ("FusedLion vs reference Lion", torch.float32,
         lambda p: FusedLion(p, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.1),
         lambda p: RefLion(p, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.1), 1e-5, 1e-6),
        ("FusedLion vs reference Lion", torch.bfloat16,
         lambda p: FusedLion(p, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.1),
         lambda p: RefLion(p, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.1), 1e-2, 1e-2),
    ]
    for name, dtype, ours, ref, rtol, atol in checks:
        try:
            results.append(_compare(name, ours, ref, dtype, args.steps, rtol, atol))
        except Exception:  # report and continue with the other checks
            print(f"FAIL {name} [{dtype}]: exception\n{traceback.format_exc()}")
            results.append(False)
    try:
        results.append(_lamb_deterministic())
    except Exception:  # report and continue
        print(f"FAIL FusedLamb deterministic: exception\n{traceback.format_exc()}")
        results.append(False)
    if args.bench:
        _bench()
    print(f"{'PASS' if all(results) else 'FAIL'} overall: {sum(results)}/{len(results)} checks passed")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
