"""Checkpoint save/load time of ``engine.save_checkpoint`` / ``load_checkpoint`` vs ``torch.save`` / ``torch.load``.

Both sides handle the same state in the same run, alternating, on the same filesystem:

* baseline save: ``{"module": ZeroStage.module_state_dict(), "optimizer": ZeroStage.state_dict(), counters,
  LR scheduler}`` through ``torch.save`` into one file (no fsync, no atomic rename, like DeepSpeed);
* baseline load: ``torch.load(weights_only=True)`` of that file, then the same ``load_module_state_dict`` /
  ``load_state_dict`` into the engine that dscore's load does ("load+apply"), and the raw read alone;
* dscore: ``engine.save_checkpoint`` (atomic, one directory per tag, safetensors) and ``load_checkpoint``,
  measured with fsync off (the default) and on (``DSCORE_CHECKPOINT_FSYNC=1``, durable across power loss).

Prints medians in seconds and the ratios dscore / baseline (target: <= 1.10). Single process, CPU.

    python bench/checkpoint.py [--params-millions 25] [--repeats 5] [--dir /tmp/x]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time


def _engine(n_million: float):
    import torch

    import dscore

    width = 2048
    layers = max(1, round(n_million * 1e6 / (width * width + width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    config = {
        "train_batch_size": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
    }
    engine, *_ = dscore.initialize(model=model, config=config)
    engine.backward(engine(torch.randn(2, width)).pow(2).mean())
    engine.step()  # optimizer moments exist
    n = sum(p.numel() for p in model.parameters())
    return engine, n


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params-millions", type=float, default=25.0, help="model size in millions of parameters")
    parser.add_argument("--repeats", type=int, default=5, help="timed repetitions per variant (median reported)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args(argv)

    import torch

    engine, n = _engine(args.params_millions)
    zero = engine.zero_stage_impl
    root = tempfile.mkdtemp(prefix="dscore-bench-ckpt-", dir=args.dir)
    baseline_file = os.path.join(root, "baseline.pt")
    times: dict[str, list[float]] = {
        k: [] for k in ("t_save", "t_read", "t_load", "d_save", "d_load", "d_save_nofsync", "d_load_nofsync")
    }

    def torch_save() -> None:
        state = {
            "module": zero.module_state_dict(),
            "optimizer": zero.state_dict(),
            "counters": engine.counters_state(),
            "lr_scheduler": engine.lr_scheduler.state_dict(),
        }
        torch.save(state, baseline_file)

    def torch_read():
        return torch.load(baseline_file, weights_only=True)

    def torch_load() -> None:
        state = torch_read()
        zero.load_module_state_dict(state["module"])
        zero.load_state_dict(state["optimizer"])
        engine.load_counters_state(state["counters"])
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])

    saved_env = os.environ.get("DSCORE_CHECKPOINT_FSYNC")
    try:
        for rep in range(args.repeats + 1):  # the first round warms caches and is dropped
            results = {
                "t_save": _timed(torch_save),
                "t_read": _timed(torch_read),
                "t_load": _timed(torch_load),
            }
            os.environ["DSCORE_CHECKPOINT_FSYNC"] = "1"
            results["d_save"] = _timed(lambda: engine.save_checkpoint(root, tag="bench"))
            results["d_load"] = _timed(lambda: engine.load_checkpoint(root, tag="bench"))
            os.environ["DSCORE_CHECKPOINT_FSYNC"] = "0"
            results["d_save_nofsync"] = _timed(lambda: engine.save_checkpoint(root, tag="bench"))
            results["d_load_nofsync"] = _timed(lambda: engine.load_checkpoint(root, tag="bench"))
            if rep:
                for k, v in results.items():
                    times[k].append(v)
        size = os.path.getsize(baseline_file)
        ours = sum(os.path.getsize(os.path.join(root, "bench", f)) for f in os.listdir(os.path.join(root, "bench")))
    finally:
        if saved_env is None:
            os.environ.pop("DSCORE_CHECKPOINT_FSYNC", None)
        else:
            os.environ["DSCORE_CHECKPOINT_FSYNC"] = saved_env
        shutil.rmtree(root, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"model: {n / 1e6:.1f} M parameters; state: torch.save file {size / 2**20:.0f} MiB, dscore tag {ours / 2**20:.0f} MiB"
    )
    print(f"repeats: {args.repeats} (median seconds; machine load affects both sides alike)")
    print(f"  torch.save                 {med['t_save']:.3f} s")
    print(f"  torch.load (read only)     {med['t_read']:.3f} s")
    print(f"  torch.load + apply         {med['t_load']:.3f} s")
    print(f"  dscore save (fsync, opt-in){med['d_save']:.3f} s   ratio {med['d_save'] / med['t_save']:.2f}x")
    print(
        f"  dscore save (default)      {med['d_save_nofsync']:.3f} s   ratio {med['d_save_nofsync'] / med['t_save']:.2f}x"
    )
    print(
        f"  dscore load (fsync run)    {med['d_load']:.3f} s   ratio {med['d_load'] / med['t_load']:.2f}x vs load+apply, "
        f"{med['d_load'] / med['t_read']:.2f}x vs read only"
    )
    print(
        f"  dscore load (no-fsync run) {med['d_load_nofsync']:.3f} s   ratio {med['d_load_nofsync'] / med['t_load']:.2f}x vs "
        f"load+apply, {med['d_load_nofsync'] / med['t_read']:.2f}x vs read only"
    )
    print("  target: <= 1.10x (DeepSpeed measured 1.06-1.43x on save)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
