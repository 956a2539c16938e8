"""Cost of the replica broadcast in ``dscore.initialize`` on the GPT example's model (``examples/gpt``).

Two gloo ranks build ``GPT(GPTConfig(...))`` from rank-dependent seeds and call ``dscore.initialize`` at
ZeRO 0, 2 and 3. The broadcast (:func:`dscore.runtime.replicas.broadcast_replicas`, called by
``build_zero_stage``) is timed from inside ``initialize`` by a recording wrapper. Printed per stage, on
rank 0: the broadcast's share of ``initialize``'s wall time (a ratio measured in the same run), its bytes
over the model's parameter + buffer bytes (1.00 = one broadcast of the model), and its collective count.

Usage::

    python bench/initialize_broadcast.py [--layers 4] [--embd 128] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "gpt"))


def _ranks(layers: int, embd: int, rounds: int) -> dict[int, Any]:
    import torch.distributed as dist
    from model import GPT, GPTConfig

    import dscore
    import dscore.runtime.assembly as assembly

    real = assembly.broadcast_replicas
    seen: list[Any] = []

    def recording(*args: Any, **kwargs: Any) -> Any:
        summary = real(*args, **kwargs)
        seen.append(summary)
        return summary

    assembly.broadcast_replicas = recording
    out: dict[int, Any] = {}
    for stage in (0, 2, 3):
        shares, summary, model_bytes = [], None, 0
        for r in range(rounds):
            torch.manual_seed(1000 * r + dist.get_rank())
            model = GPT(GPTConfig(n_layer=layers, n_embd=embd))
            model_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
            cfg = {
                "train_micro_batch_size_per_gpu": 8,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "zero_optimization": {"stage": stage},
            }
            dist.barrier()
            t0 = time.perf_counter()
            dscore.initialize(model=model, config=cfg)
            total = time.perf_counter() - t0
            summary = seen[-1]
            shares.append(summary.seconds / total)
        out[stage] = {
            "share": statistics.median(shares),
            "bytes_ratio": summary.nbytes / model_bytes,
            "mib": summary.nbytes / 2**20,
            "calls": summary.calls,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from dscore.testing import run_distributed

    res = run_distributed(_ranks, 2, args.layers, args.embd, args.rounds, timeout=900)[0]
    print(f"GPT n_layer={args.layers} n_embd={args.embd}, 2 gloo ranks, median of {args.rounds}")
    for stage, r in res.items():
        print(
            f"ZeRO {stage}: broadcast / initialize = {r['share']:.3f}; broadcast bytes / model bytes = "
            f"{r['bytes_ratio']:.2f} ({r['mib']:.1f} MiB); {r['calls']} broadcast call(s)"
        )


if __name__ == "__main__":
    main()
