"""Data-parallel throughput and memory: torch DDP vs dscore ZeRO stages 0-3 (and DeepSpeed if installed).

Two ranks on gloo (loopback), one thread each, an MLP of ``--layers`` x ``Linear(hidden, hidden)``
(default 4 x 1024), micro batch ``--micro-batch`` (64), AdamW, gradient clipping 1.0 everywhere.
Variants run in *alternating rounds* (DDP, stage 0, 1, 2, 3, [DeepSpeed 0-3], then again), each in
freshly spawned ranks so that a rank's peak RSS belongs to one variant. Reported per variant:
steps/s (median over rounds) and its ratio to DDP's, and per rank the peak RSS and the peak RSS growth
over the rank's baseline (RSS after ``import torch`` and process-group setup, before the model exists;
the growth is what the training state costs, the absolute peak is dominated by the interpreter+torch).

Targets (issues 8, 17): stage 0 >= 0.97, stages 1-2 >= 0.95, stage 3 >= 0.85 of DDP; RSS stage 1-2
<= 1.0x DDP, stage 3 <= 0.85x. Timings on a shared machine are noisy: compare ratios within one run.

Usage::

    python bench/dp_throughput.py                # 200 steps, 1 round
    python bench/dp_throughput.py --steps 50 --rounds 2
    python bench/dp_throughput.py --profile --stages 0,1,2,3          # per-phase ms/step per variant
    python bench/dp_throughput.py --widths 512,1024,2048 --chart bench/results/dp_throughput.png

Also runs torch FSDP2 (``fully_shard`` on a CPU mesh, gloo) as the stage-3 peer (``--no-fsdp2`` skips it).

The physical bound (issue 27): the row ``no-comm`` runs the same two ranks stepping with no communication
at all, each rank alone on its share of the batch (plain model, the same AdamW for-each and clipping, no
process-group call between the timing barriers). Every row is also reported as a fraction of it
(``vs bound``): what data parallelism costs over running the two shares independently.

DeepSpeed rows (``deepspeed-stageN``) run when DeepSpeed 0.19.8 is importable (the separate bench venv,
bench/README.md): the dscore row's config plus ``foreach: true`` for its ``torch_adam``, ``DS_ACCELERATOR=cpu``,
on the bench's gloo process group; ``bench/_deepspeed_peer.py`` checks on every rank before timing that
DeepSpeed really runs that (gloo, AdamW for-each, stage, buckets, overlap_comm, clipping, fp32, one thread)
and fails the row otherwise. Any failed row makes the script exit 1 after the table; ``--require-deepspeed``
exits 2 up front when DeepSpeed is not importable.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
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


def _dscore_config(stage: int, micro: int, profile: bool = False) -> dict[str, Any]:
    return {
        "wall_clock_breakdown": profile,
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


def _deepspeed_peer() -> Any:
    """bench/_deepspeed_peer.py (config, checks and quieting of the DeepSpeed rows, shared with gpt_throughput)."""
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    import _deepspeed_peer

    return _deepspeed_peer


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
    elif variant == "no-comm":
        tiny(x).sum().backward()
    elif variant == "fsdp2":
        m = _fsdp2(torch.nn.Sequential(torch.nn.Linear(8, 8)))
        m(x).sum().backward()
        del m
    elif variant.startswith("deepspeed"):
        engine, _ = _deepspeed_peer().initialize(tiny, _dscore_config(int(variant[-1]), 2))
        engine.backward(engine(x).sum())
        engine.step()
        del engine
    else:
        import dscore

        engine, *_ = dscore.initialize(model=tiny, config=_dscore_config(int(variant[-1]), 2))
        engine.backward(engine(x).sum())
        engine.step()
        del engine


def _fsdp2(model: Any) -> Any:
    """torch's own sharded data parallel (FSDP2 ``fully_shard``) on a CPU mesh: each Linear is a unit."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _worker(variant: str, hidden: int, layers: int, micro: int, steps: int, warmup: int,
            profile: bool = False) -> dict[str, Any]:
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
    from dscore.runtime.timers import PhaseTimers, active_timers

    if variant in ("ddp", "fsdp2", "no-comm"):
        if variant == "no-comm":
            ddp = model  # the bound: this rank alone on its share of the batch, nothing exchanged
        elif variant == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            ddp = DDP(model)
        else:
            ddp = _fsdp2(model)
        # foreach, as dscore's AdamW (torch_adam) builds it: the rows then differ only in data parallelism
        # (torch's CPU default is the per-parameter loop, slower at large widths and faster at small ones)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4, foreach=True)
        timers = PhaseTimers().activate() if profile else None

        def one_step() -> None:
            if timers is None:
                loss = F.mse_loss(ddp(x), y)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                return
            timers.start("forward")
            loss = F.mse_loss(ddp(x), y)
            timers.stop("forward")
            timers.start("backward")  # DDP/FSDP reduce and their final wait happen inside backward
            loss.backward()
            timers.stop("backward")
            timers.start("step")
            timers.start("step.clip")
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            timers.stop("step.clip")
            timers.start("step.optimizer")
            opt.step()
            opt.zero_grad(set_to_none=True)
            timers.stop("step.optimizer")
            timers.stop("step")

    elif variant.startswith("deepspeed"):
        stage = int(variant[-1])
        peer = _deepspeed_peer()
        engine, checked = peer.initialize(model, _dscore_config(stage, micro))
        # DeepSpeed's own wall_clock_breakdown only logs; its rows are timed by hand per engine call
        ds_timers = PhaseTimers().activate() if profile else None

        def one_step() -> None:
            peer.train_step(engine, lambda: F.mse_loss(engine(x), y), ds_timers)

    else:
        import dscore

        stage = int(variant[-1])
        engine, *_ = dscore.initialize(model=model, config=_dscore_config(stage, micro, profile))

        def one_step() -> None:
            loss = F.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()

    for _ in range(warmup):
        one_step()
    dist.barrier()
    if active_timers() is not None:
        active_timers().reset()
    t0 = time.perf_counter()
    for _ in range(steps):
        one_step()
    dist.barrier()
    elapsed = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    phases: dict[str, float] = {}
    if profile and active_timers() is not None:
        phases = {k: 1000.0 * v / steps for k, (v, _) in active_timers().totals().items()}
    out = {"steps_per_s": steps / elapsed, "peak_rss": peak, "base_rss": base, "phases_ms": phases}
    if variant.startswith("deepspeed"):
        out["deepspeed_checked"] = checked
    return out


_PHASES = (
    "forward", "forward.allgather_wait", "backward", "backward.bucket", "backward.reduce_launch",
    "backward.reduce_wait", "step", "step.clip", "step.optimizer", "step.allgather",
)


def _chart(path: str, widths: list[int], variants: list[str], speed: Any, grow: Any) -> bool:
    """PNG: steps/s (relative to DDP) and peak RSS growth (MB, rank 0) per variant and width."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("matplotlib not installed (pip install 'dscore[bench]'): no chart")
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    n = len(widths)
    bar = 0.8 / max(1, n)
    for k, w in enumerate(widths):
        xs = [i + k * bar for i in range(len(variants))]
        axes[0].bar(xs, [speed(w, v) / speed(w, "ddp") for v in variants], bar, label=f"hidden {w}")
        axes[1].bar(xs, [grow(w, v, 0) / 2**20 for v in variants], bar, label=f"hidden {w}")
    for ax, title in zip(axes, ("steps/s relative to torch DDP", "peak RSS growth, rank 0 (MB)")):
        ax.set_xticks([i + bar * (n - 1) / 2 for i in range(len(variants))])
        ax.set_xticklabels(variants, rotation=30, ha="right", fontsize=8)
        ax.set_title(title)
        ax.legend(fontsize=8)
    axes[0].axhline(1.0, color="grey", lw=0.8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="timed optimizer steps per variant and round")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds of all variants")
    parser.add_argument("--hidden", type=int, default=1024, help="model width (ignored when --widths is given)")
    parser.add_argument("--widths", default="", help="comma list of widths, e.g. 512,1024,2048")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=64)
    parser.add_argument("--stages", default="0,1,2,3", help="dscore (and DeepSpeed) stages to run")
    parser.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeed even when installed")
    parser.add_argument("--require-deepspeed", action="store_true",
                        help="exit 2 unless DeepSpeed is importable (the side-by-side run must not skip it)")
    parser.add_argument("--no-fsdp2", action="store_true", help="skip torch FSDP2 (fully_shard)")
    parser.add_argument("--profile", action="store_true",
                        help="per-phase ms/step (wall_clock_breakdown timers; DDP/FSDP2 timed by hand)")
    parser.add_argument("--chart", default="", help="write a PNG chart here (e.g. bench/results/dp_throughput.png)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    from dscore.testing import run_distributed

    stages = [int(s) for s in args.stages.split(",") if s.strip()]
    widths = [int(w) for w in args.widths.split(",") if w.strip()] or [args.hidden]
    variants = ["no-comm", "ddp"] + [f"dscore-stage{s}" for s in stages]
    if not args.no_fsdp2:
        variants.append("fsdp2")
    rows = ", ".join(f"deepspeed-stage{s}" for s in stages)
    if _deepspeed_peer().rows_wanted(args.no_deepspeed, args.require_deepspeed, rows, log):
        variants += [f"deepspeed-stage{s}" for s in stages]
    results: dict[tuple[int, str], list[list[dict[str, Any]]]] = {(w, v): [] for w in widths for v in variants}
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    failed: list[str] = []
    for w in widths:
        params = args.layers * (w * w + w)
        log.info(
            "MLP %dx%d (%.1fM params, %.1f MB fp32), micro batch %d, 2 ranks gloo, 1 thread each, %d steps x %d round(s)",
            args.layers, w, params / 1e6, params * 4 / 1e6, args.micro_batch, args.steps, args.rounds,
        )
    for r in range(args.rounds):
        for w in widths:
            for v in variants:
                try:
                    res = run_distributed(_worker, 2, v, w, args.layers, args.micro_batch, args.steps,
                                          args.warmup, args.profile, env=env, timeout=3600)
                except Exception as exc:  # noqa: BLE001 - reported with the table, then exit 1
                    log.error("round %d hidden %d %-16s FAILED:\n%s", r, w, v, exc)
                    failed.append(f"round {r} hidden {w} {v}")
                    continue
                results[(w, v)].append(res)
                log.info("round %d hidden %d %-16s %.2f steps/s", r, w, v, min(x["steps_per_s"] for x in res))
                if "deepspeed_checked" in res[0]:
                    log.info("  checked on every rank: %s", res[0]["deepspeed_checked"])

    def speed(w: int, v: str) -> float:
        # a step completes when the slowest rank completes it
        rounds = results[(w, v)]
        return statistics.median(min(x["steps_per_s"] for x in rnd) for rnd in rounds) if rounds else float("nan")

    def rss(w: int, v: str, rank: int, key: str) -> float:
        vals = [rnd[rank]["peak_rss"] - (rnd[rank]["base_rss"] if key == "delta" else 0) for rnd in results[(w, v)]]
        return statistics.median(vals) if vals else float("nan")

    lines = []
    for w in widths:
        ddp_speed = speed(w, "ddp")
        bound_speed = speed(w, "no-comm")
        lines.append(f"\nhidden {w}")
        lines.append(f"{'variant':<18}{'steps/s':>9}{'vs DDP':>8}{'vs bound':>9}" + "".join(
            f"{f'r{k} peak MB':>12}{f'r{k} grow MB':>12}{'grow/DDP':>10}" for k in range(2)
        ))
        for v in variants:
            row = f"{v:<18}{speed(w, v):>9.2f}{speed(w, v) / ddp_speed:>8.3f}{speed(w, v) / bound_speed:>9.3f}"
            for k in range(2):
                grow = rss(w, v, k, "delta")
                row += f"{rss(w, v, k, 'abs') / 2**20:>12.1f}{grow / 2**20:>12.1f}{grow / max(1.0, rss(w, 'ddp', k, 'delta')):>10.3f}"
            lines.append(row)
        if args.profile:
            lines.append(f"per-phase ms/step (rank 0, median over rounds; hidden {w}; sub-phases are inside their parent)")
            lines.append(f"{'phase':<24}" + "".join(f"{v.replace('dscore-stage', 'dscore-z').replace('deepspeed-stage', 'dspeed-z'):>12}" for v in variants))
            for ph in _PHASES:
                cells = []
                for v in variants:
                    vals = [rnd[0]["phases_ms"].get(ph) for rnd in results[(w, v)]]
                    vals = [x for x in vals if x is not None]
                    cells.append(f"{statistics.median(vals):>12.2f}" if vals else f"{'-':>12}")
                lines.append(f"{ph:<24}" + "".join(cells))
            lines.append(f"{'wall (1000/steps_s)':<24}" + "".join(f"{1000.0 / speed(w, v):>12.2f}" for v in variants))
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.write(
        "targets: stage0 >= 0.97, stage1-2 >= 0.95, stage3 >= 0.85 x DDP steps/s; "
        "RSS growth stage1-2 <= 1.0x, stage3 <= 0.85x DDP; stage3 >= FSDP2 steps/s, <= FSDP2 RSS (shared machine: noisy); "
        "'vs bound': fraction of the no-communication bound (each rank alone on its share)\n"
    )
    if args.chart and _chart(args.chart, widths, variants, speed, lambda w, v, k: rss(w, v, k, "delta")):
        log.info("chart: %s", args.chart)
    if failed:
        log.error("FAILED (%d): %s", len(failed), "; ".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
