"""Pipeline engine: measured 1F1B efficiency against the bubble bound, and activation checkpointing inside
pipeline stages (saved-activation peak and step time).

**Efficiency** (``p`` stages x ``m`` micro-batches, ``p`` gloo processes): every stage holds
``--layers-per-stage`` layers whose forward takes ``--fwd-ms`` and backward twice that, as timed waits
(``time.sleep`` inside the layer and inside a custom autograd backward) around a small real ``Linear``.
Waiting instead of computing lets 4 stages run concurrently on a 2-core machine, so what is measured is
the engine: the 1F1B order, point-to-point transfers, loss broadcast and the optimizer step. The ideal
no-bubble time of one ``train_batch`` is ``m * layers * 3 * fwd``; efficiency = ideal / measured (median
of ``--rounds`` batches after one warm-up), shown next to the 1F1B bound ``m / (m + p - 1)``.

**Activation checkpointing in a 2-stage pipeline** (real compute: pre-LayerNorm transformer blocks from
``bench/activation_checkpointing.py``, 2 processes): the peak of bytes autograd holds for backward on
each stage over a whole ``train_batch`` (every in-flight micro-batch of the 1F1B schedule, and the
recompute), counted with ``torch.autograd.graph.saved_tensors_hooks`` (each storage once while it is
saved; parameters excluded), and the ``train_batch`` time, with ``activation_checkpoint_interval`` 1
against 0. Then ``bench/activation_checkpointing.py`` is run for the single-process figures.

Usage::

    python bench/pipeline.py [--fwd-ms 15] [--layers-per-stage 2] [--rounds 3] [--skip-ckpt]

Latest figures (2026-12-01, 2-core CPU box shared with other jobs, defaults): efficiency 0.758 / 0.841
at 2 stages x 4 / 8 micro-batches (bound 0.800 / 0.889), 0.545 / 0.691 at 4 stages (bound 0.571 / 0.727),
i.e. 94-96 % of the 1F1B bound; checkpointing every block in a 2-stage pipeline: saved-activation peak
42.3 -> 6.1 MiB on stage 0 (ratio 0.145; it holds 2 micro-batches in flight) and 21.3 -> 5.6 MiB on
stage 1 (0.265), ``train_batch`` time ratio 1.42; single process 0.087 and 1.60.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
HIDDEN = 16


class _Wait(torch.autograd.Function):
    """Identity whose forward and backward wait a fixed time (a stand-in for compute)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fwd_s: float, bwd_s: float) -> torch.Tensor:
        ctx.bwd_s = bwd_s
        time.sleep(fwd_s)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        time.sleep(ctx.bwd_s)
        return grad, None, None


class TimedLayer(torch.nn.Module):
    """A small Linear plus a timed wait of ``fwd_ms`` forward and ``2 * fwd_ms`` backward."""

    def __init__(self, fwd_ms: float) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(HIDDEN, HIDDEN)
        self.fwd_s = fwd_ms / 1e3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Wait.apply(self.fc(x), self.fwd_s, 2 * self.fwd_s)


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, target)


def _efficiency_rank(stages: int, micro: int, layers_per_stage: int, fwd_ms: float, rounds: int) -> float:
    import dscore
    from dscore.pipe import LayerSpec, PipelineModule

    torch.manual_seed(0)
    pipe = PipelineModule(
        layers=[LayerSpec(TimedLayer, fwd_ms) for _ in range(stages * layers_per_stage)],
        num_stages=stages,
        loss_fn=_mse,
        partition_method="uniform",
    )
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": micro,
        "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
    }
    engine, _, _, _ = dscore.initialize(model=pipe, config=config)
    data = [(torch.randn(4, HIDDEN), torch.randn(4, HIDDEN)) for _ in range(micro)]
    import torch.distributed as dist

    times = []
    for r in range(rounds + 1):
        dist.barrier()
        t0 = time.perf_counter()
        engine.train_batch(iter(data))
        if r:  # the first batch exchanges shapes and warms up
            times.append(time.perf_counter() - t0)
    engine.close()
    return statistics.median(times)


def _ckpt_rank(interval: int, rounds: int, micro: int) -> dict[str, float]:
    sys.path.insert(0, str(HERE))
    from activation_checkpointing import Block  # the same transformer block as the single-process bench

    import dscore
    from dscore.pipe import LayerSpec, PipelineModule

    hidden, heads, seq, batch, layers = 128, 8, 128, 2, 8
    torch.manual_seed(0)
    pipe = PipelineModule(
        layers=[LayerSpec(Block, hidden, heads, 0.1) for _ in range(layers)],
        num_stages=2,
        loss_fn=_mse,
        partition_method="uniform",
        activation_checkpoint_interval=interval,
    )
    config = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": micro,
        "optimizer": {"type": "SGD", "params": {"lr": 1e-4}},
    }
    engine, _, _, _ = dscore.initialize(model=pipe, config=config)
    data = [(torch.randn(batch, seq, hidden), torch.randn(batch, seq, hidden)) for _ in range(micro)]
    params = {p.untyped_storage().data_ptr() for p in pipe.parameters()}
    live: dict[int, list[int]] = {}  # storage pointer -> [saves alive, bytes]
    state = {"now": 0, "peak": 0}

    class _Saved:
        def __init__(self, t: torch.Tensor) -> None:
            self.t = t
            self.key = t.untyped_storage().data_ptr()
            if self.key in params:
                self.key = 0
                return
            entry = live.setdefault(self.key, [0, t.untyped_storage().nbytes()])
            if entry[0] == 0:
                state["now"] += entry[1]
                state["peak"] = max(state["peak"], state["now"])
            entry[0] += 1

        def __del__(self) -> None:
            if self.key:
                entry = live[self.key]
                entry[0] -= 1
                if entry[0] == 0:
                    state["now"] -= entry[1]
                    del live[self.key]

    import torch.distributed as dist

    times = []
    with torch.autograd.graph.saved_tensors_hooks(_Saved, lambda s: s.t):
        for r in range(rounds + 1):
            dist.barrier()
            t0 = time.perf_counter()
            engine.train_batch(iter(data))
            if r:
                times.append(time.perf_counter() - t0)
    engine.close()
    return {"peak_bytes": float(state["peak"]), "time": statistics.median(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fwd-ms", type=float, default=15.0, help="forward wait per layer (backward is twice that)")
    ap.add_argument("--layers-per-stage", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-ckpt", action="store_true", help="only the efficiency sweep")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from dscore.testing import run_distributed
    from dscore_plugins.engine.pipe.schedule import bubble_bound

    print(f"1F1B efficiency: {args.layers_per_stage} layers/stage, forward {args.fwd_ms:g} ms and backward "
          f"{2 * args.fwd_ms:g} ms per layer (timed waits), median of {args.rounds} batches")
    print(f"{'stages':>6} {'micro':>5} {'ideal ms':>9} {'measured ms':>12} {'efficiency':>10} {'bound m/(m+p-1)':>16}")
    for stages in (2, 4):
        for micro in (4, 8):
            results = run_distributed(
                _efficiency_rank, stages, stages, micro, args.layers_per_stage, args.fwd_ms, args.rounds, timeout=600
            )
            measured = max(results)
            ideal = micro * args.layers_per_stage * 3 * args.fwd_ms / 1e3
            print(f"{stages:>6} {micro:>5} {1e3 * ideal:>9.1f} {1e3 * measured:>12.1f} {ideal / measured:>10.3f} "
                  f"{bubble_bound(micro, stages):>16.3f}")
    if args.skip_ckpt:
        return
    print("\nactivation checkpointing inside a 2-stage pipeline (8 transformer blocks, 4 micro-batches):")
    plain = run_distributed(_ckpt_rank, 2, 0, args.rounds, 4, timeout=900)
    ckpt = run_distributed(_ckpt_rank, 2, 1, args.rounds, 4, timeout=900)
    for stage in (0, 1):
        p, c = plain[stage], ckpt[stage]
        print(f"stage {stage}: saved-activation peak {p['peak_bytes'] / 2**20:.1f} MiB -> {c['peak_bytes'] / 2**20:.1f} MiB "
              f"(ratio {c['peak_bytes'] / p['peak_bytes']:.3f})")
    tp, tc = max(r["time"] for r in plain), max(r["time"] for r in ckpt)
    print(f"train_batch time: plain {1e3 * tp:.0f} ms, checkpointed {1e3 * tc:.0f} ms (ratio {tc / tp:.3f})")
    print("\nsingle process (bench/activation_checkpointing.py --steps 2):")
    out = subprocess.run(
        [sys.executable, str(HERE / "activation_checkpointing.py"), "--steps", "2", "--rounds", str(args.rounds)],
        capture_output=True, text=True, timeout=1800,
    )
    print(out.stdout.strip() or out.stderr.strip()[-2000:])


if __name__ == "__main__":
    main()
