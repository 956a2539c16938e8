"""Benchmark: dscore cpu_adam vs torch.optim.Adam(fused=True) on CPU, against a bandwidth roofline.

Setup: ``--params`` fp32 parameters (default 50M) split over ``--tensors`` tensors (default 8), gradients
fixed. For each thread count (``--threads 1,2``) the variants run alternately in one process, round
after round, and the median step time of each is reported:

* ``dscore``       DscoreCPUAdam.step()
* ``torch_fused``  torch.optim.Adam(fused=True).step()
* ``probe``        the cpu_adam op's STREAM-like in-place probe with Adam's traffic: read p, g, m, v and
                   write p, m, v = 28 bytes per parameter per step (the roofline)
* ``dscore+bf16``  DscoreCPUAdam.step_with_copy() writing a bf16 copy in the same pass (30 bytes/param)
* ``torch+copy``   torch fused step followed by a separate ``bf16.copy_(p)``

Printed ratios: dscore vs torch fused (target >= 1.0x), dscore vs roofline (probe time / dscore time,
target >= 95%), dscore+bf16 vs torch+copy (target >= 1.25x). Timings are wall-clock seconds from
``time.perf_counter``; bandwidths are in GB/s (1e9 bytes). On a shared machine the figures are noisy:
compare ratios measured in the same run, not absolute times.

Usage: ``python bench/cpu_adam.py --params 10000000 --rounds 5``
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Callable

import torch

logger = logging.getLogger("dscore.bench.cpu_adam")

BYTES_PER_PARAM = 28  # read p, g, m, v (4 x 4 B) + write p, m, v (3 x 4 B)


def _split(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def _make(sizes: list[int], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    params = []
    for n in sizes:
        p = torch.randn(n, generator=gen)
        p.grad = torch.randn(n, generator=gen) * 1e-3
        params.append(p)
    return params


def _time(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(total: int, tensors: int, threads_list: list[int], rounds: int, warmup: int) -> list[dict[str, float]]:
    """Run the benchmark; returns one dict of median seconds (and derived ratios) per thread count."""
    from dscore_plugins.ops.cpu_optim import DscoreCPUAdam

    sizes = _split(total, tensors)
    ours_params, ref_params = _make(sizes, 0), _make(sizes, 0)
    ours = DscoreCPUAdam(ours_params, lr=1e-4, weight_decay=0.0, adamw_mode=False)
    ref = torch.optim.Adam(ref_params, lr=1e-4, fused=True)
    ours.step()  # creates state
    ref.step()
    op = ours._op
    # the probe gets its own arrays: it must not disturb the optimizers' values (v += g could go negative)
    probe_arrays = [[torch.rand(n) for _ in range(4)] for n in sizes]
    bf16_ours = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
    bf16_ref = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]

    def probe() -> None:
        t = torch.get_num_threads()
        for p, g, m, v in probe_arrays:
            op.stream_probe(p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), p.numel(), t)

    def torch_then_copy() -> None:
        ref.step()
        for c, p in zip(bf16_ref, ref_params):
            c.copy_(p)

    variants: dict[str, Callable[[], object]] = {
        "dscore": ours.step,
        "torch_fused": ref.step,
        "probe": probe,
        "dscore+bf16": lambda: ours.step_with_copy(bf16_ours),
        "torch+copy": torch_then_copy,
    }
    results = []
    for threads in threads_list:
        if not all(bool(torch.isfinite(p).all()) for p in ours_params):
            raise RuntimeError("benchmark parameters became non-finite")
        torch.set_num_threads(threads)
        samples: dict[str, list[float]] = {k: [] for k in variants}
        names = list(variants)
        for r in range(warmup + rounds):
            # alternate every round, rotating the order so no variant always runs after the same one
            order = names[r % len(names):] + names[: r % len(names)]
            for name in order:
                seconds = _time(variants[name])
                if r >= warmup:
                    samples[name].append(seconds)
        med = {k: statistics.median(v) for k, v in samples.items()}
        med["threads"] = threads
        med["probe_gbps"] = BYTES_PER_PARAM * total / med["probe"] / 1e9
        med["dscore_gbps"] = BYTES_PER_PARAM * total / med["dscore"] / 1e9
        med["vs_torch"] = med["torch_fused"] / med["dscore"]
        med["vs_roofline"] = med["probe"] / med["dscore"]
        med["bf16_vs_torch_copy"] = med["torch+copy"] / med["dscore+bf16"]
        results.append(med)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=50_000_000, help="total fp32 parameters (elements)")
    parser.add_argument("--tensors", type=int, default=8, help="number of parameter tensors")
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per variant (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    threads = [int(t) for t in args.threads.split(",") if t.strip()]
    print(f"cpu_adam benchmark: {args.params:,} fp32 params in {args.tensors} tensors, torch {torch.__version__}, "
          f"rounds={args.rounds} (median seconds per step)")
    header = (f"{'threads':>7} {'dscore':>9} {'torch':>9} {'probe':>9} {'ds+bf16':>9} {'t+copy':>9} "
              f"{'probe GB/s':>10} {'vs torch':>9} {'roofline':>9} {'bf16 vs':>8}")
    print(header)
    for r in run(args.params, args.tensors, threads, args.rounds, args.warmup):
        print(f"{int(r['threads']):>7} {r['dscore']:>9.4f} {r['torch_fused']:>9.4f} {r['probe']:>9.4f} "
              f"{r['dscore+bf16']:>9.4f} {r['torch+copy']:>9.4f} {r['probe_gbps']:>10.2f} "
              f"{r['vs_torch']:>8.2f}x {r['vs_roofline']:>8.1%} {r['bf16_vs_torch_copy']:>7.2f}x")
    print("targets: vs torch >= 1.00x, roofline >= 95%, bf16 variant vs torch+copy >= 1.25x")


if __name__ == "__main__":
    main()
