"""Train a small byte-level GPT with dscore — the main job.

    dscore run --num_gpus 2 examples/gpt/train.py --deepspeed_config examples/gpt/ds_config.json
    python examples/gpt/train.py            # one process; the ds_config next to this file by default

Reads the Python standard library's sources (or ``--data PATH``), trains with the engine that
``dscore.initialize`` builds from the config (ZeRO stage, optimizer, LR schedule, precision, monitor),
prints progress with an ETA, evaluates on held-out files, saves a checkpoint every ``--save_interval``
steps and resumes from ``latest`` when re-run (``--no-resume`` deletes the earlier checkpoints and starts
over), and ends with a generated sample. ``--steps`` sets the LR schedule's length too: a scheduler with
``total_num_steps`` gets ``--steps`` and a warm-up scaled by the same factor. Batches are drawn from a
generator seeded by (seed, rank, step), so a resumed run sees exactly the batches an uninterrupted run
would have seen.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from data import bits, get_batch, load_corpus, unigram_baseline  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

import dscore  # noqa: E402
from dscore.config.loader import read_source  # noqa: E402

log = logging.getLogger("gpt")
HERE = Path(__file__).resolve().parent


class RankZeroParser(argparse.ArgumentParser):
    """An ArgumentParser whose ``--help``, usage and error text is printed by rank 0 only.

    ``dscore run`` starts the script once per rank, so a plain parser prints ``--help`` once per process;
    the other ranks exit with the same status, silently. ``RANK`` is set by the launcher (unset: rank 0).
    """

    def _print_message(self, message: str, file: Any = None) -> None:
        if _is_rank_zero():
            super()._print_message(message, file)

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        # Every rank parses the same arguments, so rank 0 fails too and its exit code ends the job. A silent
        # rank exiting non-zero first would make the launcher stop rank 0 before it printed why.
        super().exit(status if _is_rank_zero() else 0, message)


def _is_rank_zero() -> bool:
    return os.environ.get("RANK", "0").strip() in ("", "0")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = RankZeroParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=None, help="text file or folder (default: the Python standard library's .py files)")
    p.add_argument("--steps", type=int, default=400,
                   help="optimizer steps in total; also the LR schedule's total_num_steps (warm-up scaled to match)")
    p.add_argument("--eval_interval", type=int, default=100, help="evaluate every N steps")
    p.add_argument("--eval_batches", type=int, default=16, help="validation batches per evaluation and rank")
    p.add_argument("--save_interval", type=int, default=100, help="save a checkpoint every N steps")
    p.add_argument("--log_interval", type=int, default=20, help="print a progress line every N steps")
    p.add_argument("--checkpoint_dir", default="runs/gpt/checkpoints", help="where checkpoints and `latest` live")
    p.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                   help="resume from `latest` if present; --no-resume deletes the global_step* checkpoints and "
                        "`latest` in --checkpoint_dir first (nothing else there) and starts over")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--block_size", type=int, default=128)
    p.add_argument("--n_layer", type=int, default=4)
    p.add_argument("--n_head", type=int, default=4)
    p.add_argument("--n_embd", type=int, default=128)
    p.add_argument("--sample_bytes", type=int, default=300, help="length of the generated sample")
    p = dscore.add_config_arguments(p)  # --deepspeed_config and the --local_rank that `dscore run` passes
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be at least 1, got {args.steps}")
    if args.deepspeed_config is None and args.deepscale_config is None:
        args.deepspeed_config = str(HERE / "ds_config.json")
    return args


def fit_schedule(config: dict[str, Any], steps: int) -> str | None:
    """Make the config's LR schedule span ``steps`` optimizer steps; returns what changed, in words.

    Schedulers with ``total_num_steps`` (``WarmupCosineLR``, ``WarmupDecayLR``) get ``steps`` there and
    ``warmup_num_steps`` scaled by the same factor (at least 1). Other schedules (``WarmupLR``, ``OneCycle``,
    ...) have no end and are left alone (None is returned).
    """
    sched = config.get("scheduler")
    params = sched.get("params") if isinstance(sched, dict) else None
    total = params.get("total_num_steps") if isinstance(params, dict) else None
    if not isinstance(total, int) or isinstance(total, bool) or total < 1:
        return None
    warmup = params.get("warmup_num_steps")
    if total == steps:
        return f"{sched.get('type')} over {steps} steps, {warmup} of them warm-up"
    params["total_num_steps"] = steps
    note = ""
    if isinstance(warmup, int) and not isinstance(warmup, bool):
        params["warmup_num_steps"] = max(1, round(warmup * steps / total))
        note = f", {params['warmup_num_steps']} of them warm-up"
        warmup_text = f" and warmup_num_steps {warmup}"
    else:
        warmup_text = ""
    return (
        f"{sched.get('type')} over {steps} steps{note} (fitted to --steps; the ds_config says "
        f"total_num_steps {total}{warmup_text})"
    )


_CHECKPOINT_NAME = re.compile(r"^(global_step\d+|\.global_step\d+\.tmp-.*)$")


def clear_checkpoints(ckpt: Path) -> list[str]:
    """Delete what earlier runs of this script saved in ``ckpt``: ``latest`` and the ``global_step<N>``
    folders (plus unfinished ``.global_step<N>.tmp-*`` ones). Anything else in the folder is left alone.
    Returns the names removed."""
    removed: list[str] = []
    if not ckpt.is_dir():
        return removed
    for entry in sorted(ckpt.iterdir()):
        if entry.is_dir() and not entry.is_symlink() and _CHECKPOINT_NAME.match(entry.name):
            shutil.rmtree(entry)
            removed.append(entry.name)
        elif entry.name == "latest" and entry.is_file():
            entry.unlink()
            removed.append(entry.name)
    return removed


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def say(msg: str) -> None:
    if rank() == 0:
        print(msg, flush=True)


@torch.no_grad()
def evaluate(engine, stream: torch.Tensor, batches: int, batch_size: int, block: int, seed: int) -> float:
    """Mean loss (nats/byte) over ``batches`` fixed windows per rank, averaged over ranks."""
    engine.eval()
    g = torch.Generator().manual_seed(seed * 7919 + rank())
    total = torch.zeros(())
    device = next(engine.module.parameters()).device
    for _ in range(batches):
        x, y = get_batch(stream, batch_size, block, g)
        total += engine(x.to(device), y.to(device)).float().cpu()
    engine.train()
    mean = total / batches
    if dist.is_initialized():
        dist.all_reduce(mean)
        mean /= world()
    return float(mean)


class StopRequest:
    """Ctrl-C (SIGINT, forwarded to every rank by ``dscore run``) asks for a stop at the next optimizer
    step: all ranks agree on it with a one-element all-reduce per step, save a checkpoint and exit 130,
    so no rank is left waiting in a collective. A second Ctrl-C stops at once."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def agreed(self) -> bool:
        flag = torch.tensor([1.0 if self.requested else 0.0])
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def save(engine, ckpt: Path, steps_target: int) -> None:
    """Save a checkpoint (every rank takes part) tagged ``global_step<N>`` and say where and how long."""
    tag = f"global_step{engine.global_steps}"
    start = time.perf_counter()
    engine.save_checkpoint(str(ckpt), tag=tag, client_state={"steps_target": steps_target})
    say(f"saved checkpoint {ckpt / tag} ({time.perf_counter() - start:.1f} s)")


def fmt_time(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    torch.manual_seed(args.seed)  # same initial weights on every rank
    try:
        corpus = load_corpus(args.data)
    except (OSError, ValueError) as exc:  # a bad --data: one line, not a traceback per rank
        say(f"train.py: error: --data: {exc}")
        return 2
    cfg = GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    model = GPT(cfg)

    # --steps sets the LR schedule's length: read the ds_config, fit the schedule, hand the dict over
    config, _, notes = read_source(args)
    for note in notes:  # e.g. --deepscale_config is deprecated
        log.warning("%s", note)
    schedule_note = fit_schedule(config, args.steps)
    args.deepspeed_config = args.deepscale_config = None
    engine, _, _, _ = dscore.initialize(args=args, model=model, model_parameters=model.parameters(), config=config)
    micro = engine.train_micro_batch_size_per_gpu()
    gas = engine.gradient_accumulation_steps()
    device = next(engine.module.parameters()).device
    baseline = unigram_baseline(corpus.train, corpus.val)
    say(
        f"corpus: {corpus.source}: {corpus.n_files} files, {corpus.train.numel():,} train / "
        f"{corpus.val.numel():,} validation bytes; unigram baseline {baseline:.3f} nats/byte ({bits(baseline):.2f} bits)"
    )
    say(
        f"model: {model.num_parameters():,} parameters; world size {world()}, micro batch {micro}, "
        f"gradient accumulation {gas}, train batch {engine.train_batch_size()}"
    )
    if schedule_note:
        say(f"lr schedule: {schedule_note}")

    ckpt = Path(args.checkpoint_dir)
    if not args.resume:
        removed = clear_checkpoints(ckpt) if rank() == 0 else []
        if dist.is_initialized():
            dist.barrier()  # no rank saves into the folder while rank 0 is still clearing it
        if removed:
            say(f"--no-resume: deleted the earlier checkpoints in {ckpt}: {', '.join(removed)}")
    elif ckpt.is_dir():
        path, client = engine.load_checkpoint(str(ckpt))
        if path is not None:
            say(f"resumed from {path} at step {engine.global_steps}")
            target = (client or {}).get("steps_target")
            if target is not None and target != args.steps and schedule_note:
                say(f"note: that run was for --steps {target}; the LR schedule now follows --steps {args.steps}")
    start_step = engine.global_steps
    if start_step >= args.steps:
        say(f"already trained {start_step} >= --steps {args.steps}; nothing to do (use --no-resume to start over)")

    t0 = time.time()
    last_t, last_step, loss_ema = t0, start_step, None
    stop = StopRequest()
    try:
        while engine.global_steps < args.steps:
            step = engine.global_steps
            for micro_idx in range(gas):
                g = torch.Generator().manual_seed(((args.seed * 1_000_003 + step) * 64 + micro_idx) * 4096 + rank())
                x, y = get_batch(corpus.train, micro, cfg.block_size, g)
                loss = engine(x.to(device), y.to(device))
                engine.backward(loss)
                engine.step()
            value = float(loss.detach())
            loss_ema = value if loss_ema is None else 0.9 * loss_ema + 0.1 * value
            done = engine.global_steps
            if done % args.log_interval == 0 or done == args.steps:
                now = time.time()
                rate = (done - last_step) * engine.train_batch_size() / max(now - last_t, 1e-9)
                eta = (args.steps - done) * (now - t0) / max(done - start_step, 1)
                say(
                    f"step {done:>5}/{args.steps} | loss {loss_ema:.3f} | lr {engine.get_lr()[0]:.2e} | "
                    f"{rate:,.0f} samples/s | ETA {fmt_time(eta)}"
                )
                last_t, last_step = now, done
            if done % args.eval_interval == 0 or done == args.steps:
                val = evaluate(engine, corpus.val, args.eval_batches, micro, cfg.block_size, args.seed)
                say(f"eval  step {done:>5} | validation loss {val:.3f} nats/byte (unigram baseline {baseline:.3f})")
            if done % args.save_interval == 0 or done == args.steps:
                save(engine, ckpt, args.steps)
            elif stop.agreed():
                save(engine, ckpt, args.steps)
                say(f"\ninterrupted: saved step {done} to {ckpt}; run the same command again to resume")
                return 130
    except KeyboardInterrupt:
        say(f"\nstopped at step {engine.global_steps} without saving; re-running resumes from {ckpt}/latest")
        return 130

    if engine.global_steps == start_step:
        wall_note = "nothing left to train"
    else:
        wall_note = f"{engine.global_steps - start_step} steps in {fmt_time(time.time() - t0)}"
    train_loss = evaluate(engine, corpus.train, args.eval_batches, micro, cfg.block_size, args.seed + 1)
    val_loss = evaluate(engine, corpus.val, args.eval_batches, micro, cfg.block_size, args.seed)
    gap = 1.0 - val_loss / baseline
    say(
        f"done: step {engine.global_steps} ({wall_note}) | train loss {train_loss:.3f} | validation loss "
        f"{val_loss:.3f} nats/byte, {abs(gap):.0%} {'below' if gap >= 0 else 'above'} the unigram baseline "
        f"of {baseline:.3f}"
    )
    if rank() == 0:
        model = engine.module
        prompt = b"def "
        idx = torch.tensor([list(prompt)], dtype=torch.long, device=device)
        out = model.generate(idx, args.sample_bytes, generator=torch.Generator().manual_seed(args.seed))
        text = bytes(out[0].tolist()).decode("utf-8", errors="replace")
        print("----- sample -----\n" + text + "\n------------------", flush=True)
    if math.isnan(val_loss):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
