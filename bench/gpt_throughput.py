"""The main job's peer row: the GPT example's model trained as plain torch DDP vs through dscore ZeRO 0 and 2.

Two ranks on gloo (loopback), one thread each, ``examples/gpt/model.py``'s ``GPT`` at its default size
(4 layers, 128 wide, context 128, byte vocabulary), the example's optimizer settings (AdamW lr 2e-3,
betas 0.9/0.95, weight decay 0.1, clipping 1.0) and batch shape (micro batch 8, gradient accumulation 2;
DDP skips the all-reduce of the first micro step with ``no_sync``, as dscore does). Every variant sees the
same batches: byte sequences drawn from a generator seeded by (rank, step), so the data do not depend on
the variant (throughput does not depend on their content). ZeRO runs without CPU offload (DDP has none)
and with ``overlap_comm: true``. Variants alternate in rounds, each in freshly spawned ranks; reported:
samples/s (global, median over rounds; the slower rank decides) and its ratio to DDP's.

Target (issue 17): ZeRO 0 and 2 >= 0.95 x DDP. Timings on a shared machine are noisy: compare within a run.

When DeepSpeed 0.19.8 is importable (the separate bench venv, bench/README.md) the same job also runs
through DeepSpeed ZeRO 0 and 2 (rows ``deepspeed-zero0/2``): the dscore config plus ``foreach: true`` for its
``torch_adam``, ``DS_ACCELERATOR=cpu``, on the bench's gloo process group, checked on every rank before
timing by ``bench/_deepspeed_peer.py`` (a mismatch fails the row; any failed row exits 1 after the table).
``--require-deepspeed`` exits 2 when DeepSpeed is not importable; ``--no-deepspeed`` skips it.

Usage::

    python bench/gpt_throughput.py --steps 30 --rounds 3
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("dscore.bench.gpt_throughput")

MICRO, GAS, LR, CLIP = 8, 2, 2e-3, 1.0
GPT_DIR = Path(__file__).resolve().parent.parent / "examples" / "gpt"


def _config(stage: int, profile: bool = False) -> dict[str, Any]:
    return {
        "wall_clock_breakdown": profile,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": CLIP,
        "steps_per_print": 10**9,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "torch_adam": True},
        },
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 5e7,
            "allgather_bucket_size": 5e7,
            "overlap_comm": True,
            "contiguous_gradients": True,
        },
    }


def _worker(variant: str, steps: int, warmup: int, profile: bool = False) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(GPT_DIR))
    from model import GPT, GPTConfig

    logging.getLogger("dscore").setLevel(logging.WARNING)
    rank = dist.get_rank()
    cfg = GPTConfig()
    torch.manual_seed(0)
    model = GPT(cfg)

    def batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1_000_003 * rank + 1009 * step + micro)
        seq = torch.randint(0, cfg.vocab_size, (MICRO, cfg.block_size + 1), generator=g)
        return seq[:, :-1], seq[:, 1:]

    checked: dict[str, Any] | None = None
    ds_timers = None
    if variant == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                                foreach=True)  # as dscore's AdamW (torch_adam) builds it

        def one_step(step: int) -> None:
            for m in range(GAS):
                x, y = batch(step, m)
                if m < GAS - 1:
                    with ddp.no_sync():
                        (ddp(x, y) / GAS).backward()
                else:
                    (ddp(x, y) / GAS).backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), CLIP)
            opt.step()
            opt.zero_grad(set_to_none=True)

    elif variant.startswith("deepspeed"):
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import _deepspeed_peer

        engine, checked = _deepspeed_peer.initialize(model, _config(int(variant[-1])))
        if profile:  # DeepSpeed's own wall_clock_breakdown only logs: its engine calls are timed by hand
            from dscore.runtime.timers import PhaseTimers

            ds_timers = PhaseTimers().activate()

        def one_step(step: int) -> None:
            for m in range(GAS):
                x, y = batch(step, m)
                _deepspeed_peer.train_step(engine, lambda x=x, y=y: engine(x, y), ds_timers)

    else:
        import dscore

        engine, *_ = dscore.initialize(model=model, config=_config(int(variant[-1]), profile))

        def one_step(step: int) -> None:
            for m in range(GAS):
                x, y = batch(step, m)
                engine.backward(engine(x, y))
                engine.step()

    for s in range(warmup):
        one_step(s)
    dist.barrier()
    from dscore.runtime.timers import active_timers

    timers = active_timers()
    if timers is not None:
        timers.reset()
    t0 = time.perf_counter()
    for s in range(steps):
        one_step(warmup + s)
    dist.barrier()
    elapsed = time.perf_counter() - t0
    world = dist.get_world_size()
    phases = {k: 1000.0 * v / steps for k, (v, _) in timers.totals().items()} if timers is not None else {}
    return {"samples_per_s": steps * GAS * MICRO * world / elapsed, "phases_ms": phases, "deepspeed_checked": checked}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="timed optimizer steps per variant and round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of all variants")
    parser.add_argument("--profile", action="store_true",
                        help="print per-phase ms/step (rank 0, every round): dscore's timers; DeepSpeed timed by hand")
    parser.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeed even when installed")
    parser.add_argument("--require-deepspeed", action="store_true",
                        help="exit 2 unless DeepSpeed is importable (the side-by-side run must not skip it)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    from dscore.testing import run_distributed

    variants = ["ddp", "dscore-zero0", "dscore-zero2"]
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _deepspeed_peer

    if _deepspeed_peer.rows_wanted(args.no_deepspeed, args.require_deepspeed, "deepspeed-zero0, deepspeed-zero2", log):
        variants += ["deepspeed-zero0", "deepspeed-zero2"]
    results: dict[str, list[float]] = {v: [] for v in variants}
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    failed: list[str] = []
    log.info("GPT example model (default size), micro batch %d x GAS %d x 2 ranks gloo, %d steps x %d round(s)",
             MICRO, GAS, args.steps, args.rounds)
    for r in range(args.rounds):
        for v in variants:
            try:
                res = run_distributed(_worker, 2, v, args.steps, args.warmup, args.profile, env=env, timeout=3600)
            except Exception as exc:  # noqa: BLE001 - reported with the table, then exit 1
                log.error("round %d %-16s FAILED:\n%s", r, v, exc)
                failed.append(f"round {r} {v}")
                continue
            results[v].append(min(x["samples_per_s"] for x in res))
            if res[0]["phases_ms"]:
                log.info("  %s ms/step: %s", v, ", ".join(f"{k} {t:.1f}" for k, t in sorted(res[0]["phases_ms"].items())))
            log.info("round %d %-16s %.1f samples/s", r, v, results[v][-1])
            if res[0]["deepspeed_checked"] is not None:
                log.info("  checked on every rank: %s", res[0]["deepspeed_checked"])

    def median(v: str) -> float:
        return statistics.median(results[v]) if results[v] else float("nan")

    ddp = median("ddp")
    lines = [f"{'variant':<16}{'samples/s':>11}{'vs DDP':>8}"]
    for v in variants:
        lines.append(f"{v:<16}{median(v):>11.1f}{median(v) / ddp:>8.3f}")
    sys.stdout.write("\n".join(lines) + "\ntarget: ZeRO 0 and 2 >= 0.95 x DDP (shared machine: noisy)\n")
    if failed:
        log.error("FAILED (%d): %s", len(failed), "; ".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
