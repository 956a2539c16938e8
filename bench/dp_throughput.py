"""Data-parallel throughput and memory: torch DDP vs dscore ZeRO stages 0-3 (and DeepSpeed if installed).

Two ranks on gloo (loopback), one thread each, an MLP of ``--layers`` x ``Linear(hidden, hidden)``
(default 4 x 1024), micro batch ``--micro-batch`` (64), AdamW, gradient clipping 1.0 everywhere.
Variants run in *alternating rounds* (DDP, stage 0, 1, 2, 3, [DeepSpeed 0-3], then again), each in
freshly spawned ranks so that a rank's peak RSS belongs to one variant. Reported per variant:
steps/s (median over rounds) and its ratio to DDP's, and per rank the peak RSS and the peak RSS growth
over the rank's baseline (RSS after ``import torch`` and process-group setup, before the model exists;
the growth is what the training state costs, the absolute peak is dominated by the interpreter+torch).

Targets from issue 8: stage 0 >= 0.97, stages 1-2 >= 0.95, stage 3 >= 0.85 of DDP; RSS stage 1-2
<= 1.0x DDP, stage 3 <= 0.85x. Timings on a shared machine are noisy: compare ratios within one run.

Usage::

    python bench/dp_throughput.py                # 200 steps, 1 round
    python bench/dp_throughput.py --steps 50 --rounds 2
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib.util
import logging
import os
import resource
import statistics
import sys
import time
from typing import Any

log = logging.getLogger("dscore.bench.dp_throughput")

BUCKET = 1_000_000  # elements (4 MB fp32): a few buckets, so reduction overlaps backward


def _mlp(hidden: int, layers: int) -> Any:
    import torch

    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for i in range(layers):
        mods.append(torch.nn.Linear(hidden, hidden))
        if i < layers - 1:
            mods.append(torch.nn.ReLU())
    return torch.nn.Sequential(*mods)


def _rss_bytes() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def _dscore_config(stage: int, micro: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": BUCKET,
            "allgather_bucket_size": BUCKET,
            "overlap_comm": True,
        },
    }


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _warm_imports(variant: str) -> None:
    """One step of the same variant on a tiny model, so the baseline RSS already holds every module
    and runtime structure the variant loads (plugins, pydantic models, DDP reducer code)."""
    import torch

    tiny = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8)
    if variant == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        m = DDP(tiny)
        m(x).sum().backward()
        del m
    elif variant.startswith("deepspeed"):
        import deepspeed

        engine, *_ = deepspeed.initialize(model=tiny, model_parameters=tiny.parameters(),
                                          config=_dscore_config(int(variant[-1]), 2))
        engine.backward(engine(x).sum())
        engine.step()
        del engine
    else:
        import dscore

        engine, *_ = dscore.initialize(model=tiny, config=_dscore_config(int(variant[-1]), 2))
        engine.backward(engine(x).sum())
        engine.step()
        del engine


def _worker(variant: str, hidden: int, layers: int, micro: int, steps: int, warmup: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    logging.getLogger("dscore").setLevel(logging.WARNING)
    rank = dist.get_rank()
    _warm_imports(variant)
    gc.collect()
    _malloc_trim()
    dist.barrier()
    base = _rss_bytes()
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(micro, hidden, generator=g)
    y = torch.randn(micro, hidden, generator=g)
    model = _mlp(hidden, layers)
    if variant == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)

        def one_step() -> None:
            loss = F.mse_loss(ddp(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

    elif variant.startswith("deepspeed"):
        import deepspeed

        stage = int(variant[-1])
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=_dscore_config(stage, micro))

        def one_step() -> None:
            loss = F.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()

    else:
        import dscore

        stage = int(variant[-1])
        engine, *_ = dscore.initialize(model=model, config=_dscore_config(stage, micro))

        def one_step() -> None:
            loss = F.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()

    for _ in range(warmup):
        one_step()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        one_step()
    dist.barrier()
    elapsed = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    return {"steps_per_s": steps / elapsed, "peak_rss": peak, "base_rss": base}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="timed optimizer steps per variant and round")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds of all variants")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=64)
    parser.add_argument("--stages", default="0,1,2,3", help="dscore (and DeepSpeed) stages to run")
    parser.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeed even when installed")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    from dscore.testing import run_distributed

    stages = [int(s) for s in args.stages.split(",") if s.strip()]
    variants = ["ddp"] + [f"dscore-stage{s}" for s in stages]
    if args.no_deepspeed:
        log.info("DeepSpeed: skipped (--no-deepspeed)")
    elif importlib.util.find_spec("deepspeed") is None:
        log.info("DeepSpeed: not installed (pip install 'dscore[bench]' for the side-by-side run); skipping")
    else:
        variants += [f"deepspeed-stage{s}" for s in stages]
    params = args.layers * (args.hidden * args.hidden + args.hidden)
    log.info(
        "MLP %dx%d (%.1fM params, %.1f MB fp32), micro batch %d, 2 ranks gloo, 1 thread each, %d steps x %d round(s)",
        args.layers, args.hidden, params / 1e6, params * 4 / 1e6, args.micro_batch, args.steps, args.rounds,
    )
    results: dict[str, list[list[dict[str, Any]]]] = {v: [] for v in variants}
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    for r in range(args.rounds):
        for v in variants:
            res = run_distributed(_worker, 2, v, args.hidden, args.layers, args.micro_batch, args.steps,
                                  args.warmup, env=env, timeout=3600)
            results[v].append(res)
            log.info("round %d %-16s %.2f steps/s", r, v, min(x["steps_per_s"] for x in res))

    def speed(v: str) -> float:
        # a step completes when the slowest rank completes it
        return statistics.median(min(x["steps_per_s"] for x in rnd) for rnd in results[v])

    def rss(v: str, rank: int, key: str) -> float:
        vals = [rnd[rank]["peak_rss"] - (rnd[rank]["base_rss"] if key == "delta" else 0) for rnd in results[v]]
        return statistics.median(vals)

    ddp_speed = speed("ddp")
    header = f"{'variant':<18}{'steps/s':>9}{'vs DDP':>8}" + "".join(
        f"{f'r{k} peak MB':>12}{f'r{k} grow MB':>12}{'grow/DDP':>10}" for k in range(2)
    )
    lines = [header]
    for v in variants:
        row = f"{v:<18}{speed(v):>9.2f}{speed(v) / ddp_speed:>8.3f}"
        for k in range(2):
            grow = rss(v, k, "delta")
            row += f"{rss(v, k, 'abs') / 2**20:>12.1f}{grow / 2**20:>12.1f}{grow / max(1.0, rss('ddp', k, 'delta')):>10.3f}"
        lines.append(row)
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.write(
        "targets: stage0 >= 0.97, stage1-2 >= 0.95, stage3 >= 0.85 x DDP steps/s; "
        "RSS growth stage1-2 <= 1.0x, stage3 <= 0.85x DDP (shared machine: noisy)\n"
    )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
