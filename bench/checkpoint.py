"""Checkpoint save/load time of ``engine.save_checkpoint`` / ``load_checkpoint`` vs ``torch.save`` / ``torch.load``.

Both sides handle the same state in the same run, alternating, on the same filesystem:

* baseline save: ``{"module": ZeroStage.module_state_dict(), "optimizer": ZeroStage.state_dict(), counters,
  LR scheduler}`` through ``torch.save`` into one file (no fsync, no atomic rename, like DeepSpeed);
* baseline load: ``torch.load(weights_only=True)`` of that file, then the same ``load_module_state_dict`` /
  ``load_state_dict`` into the engine that dscore's load does ("load+apply"), and the raw read alone;
* dscore: ``engine.save_checkpoint`` (atomic, one directory per tag, safetensors) and ``load_checkpoint``,
  measured with fsync off (the default) and on (``DSCORE_CHECKPOINT_FSYNC=1``, durable across power loss).

Prints medians in seconds and the ratios dscore / baseline (target: <= 1.10). Single process, CPU.

DeepSpeed checkpoints (``--deepspeed``): a 25M-parameter ZeRO-2 checkpoint written by DeepSpeed itself (2
gloo ranks on CPU) is generated with ``--deepspeed-python`` (an interpreter that can import deepspeed;
default: this one when it can) or taken from ``--deepspeed-dir``. Each measurement runs in a fresh process
(wall time and peak RSS from ``wait4``): ``dscore checkpoint import`` (safe, streamed) and ``export --fp32``
vs ``torch.load(weights_only=False)`` of the same files (DeepSpeed's own way), and the floor of a process
that only imports torch and dscore.

    python bench/checkpoint.py [--params-millions 25] [--repeats 5] [--dir /tmp/x]
    python bench/checkpoint.py --deepspeed [--deepspeed-python /tmp/dsvenv/bin/python | --deepspeed-dir D]
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


_DS_GENERATOR = r"""
import os, sys, torch, deepspeed
out, width, layers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 2}}
eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
eng.backward(eng(torch.randn(2, width)).pow(2).mean()); eng.step()
eng.save_checkpoint(out, client_state={"bench": True})
"""

_MEASURE = r"""
import os, sys, time, resource
mode, src, dst = sys.argv[1], sys.argv[2], sys.argv[3]
import torch
if mode != "torch_load":
    import dscore.checkpoint.deepspeed as ds
t0 = time.perf_counter()
if mode == "import":
    ds.import_checkpoint(src, dst)
elif mode == "export":
    ds.export_fp32(src, dst)
elif mode == "engine":
    import dscore
    width, layers = int(os.environ["BENCH_WIDTH"]), int(os.environ["BENCH_LAYERS"])
    torch.manual_seed(1)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 2}}
    engine, *_ = dscore.initialize(model=model, config=cfg)
    engine.backward(engine(torch.randn(4, width)).pow(2).mean()); engine.step()  # moments allocated
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    engine.load_checkpoint(src)
    print(time.perf_counter() - t0, before)
    raise SystemExit(0)
elif mode == "torch_load":
    tag = open(os.path.join(src, "latest")).read().strip()
    objs = [torch.load(os.path.join(src, tag, f), map_location="cpu", weights_only=False)
            for f in sorted(os.listdir(os.path.join(src, tag))) if f.endswith(".pt")]
print(time.perf_counter() - t0)
"""


def _run_measured(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, int]:
    """Run ``cmd`` in a fresh process; return (seconds it printed, its peak RSS in bytes via wait4)."""
    import subprocess

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    assert proc.stdout is not None
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed with exit code {proc.returncode}")
    fields = out.strip().splitlines()[-1].split()
    if len(fields) > 1:  # the child measured its own floor (RSS before the timed part)
        _FLOORS[" ".join(cmd[3:4])] = int(fields[1])
    return float(fields[0]), int(usage.ru_maxrss) * 1024


_FLOORS: dict[str, int] = {}


def _make_deepspeed_checkpoint(python: str, root: str, n_million: float) -> str:
    """Write a ZeRO-2 checkpoint with DeepSpeed itself on 2 CPU gloo ranks; returns its directory."""
    import socket
    import subprocess

    width = 2048
    layers = max(1, round(n_million * 1e6 / (width * width + width)))
    out = os.path.join(root, "deepspeed_z2")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = dict(os.environ, DS_ACCELERATOR="cpu", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([python, "-c", _DS_GENERATOR, out, str(width), str(layers)], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    errors = [p.communicate(timeout=1800)[1] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("DeepSpeed failed to write the checkpoint:\n" + "\n".join(e[-1500:] for e in errors))
    for name in ("zero_to_fp32.py", "zero_to_torch.py"):  # DeepSpeed's helper scripts: not measured
        if os.path.exists(os.path.join(out, name)):
            os.unlink(os.path.join(out, name))
    return out


def deepspeed_bench(args: argparse.Namespace) -> int:
    """Import/export of a DeepSpeed ZeRO-2 checkpoint vs torch.load of the same files (time, peak RSS)."""
    import subprocess
    import sys

    root = tempfile.mkdtemp(prefix="dscore-bench-ds-", dir=args.dir)
    try:
        ds_dir = args.deepspeed_dir
        if ds_dir is None:
            python = args.deepspeed_python or sys.executable
            # a `deepspeed` that is dscore's compatibility layer (compat/deepspeed) is not DeepSpeed
            probe = subprocess.run(
                [python, "-c", "import deepspeed; assert not getattr(deepspeed, '__dscore__', False)"], capture_output=True
            )
            if probe.returncode != 0:
                print("DeepSpeed is not importable by", python, "(or it is dscore's compatibility layer) - pass "
                      "--deepspeed-python or --deepspeed-dir")
                return 2
            t0 = time.perf_counter()
            ds_dir = _make_deepspeed_checkpoint(python, root, args.params_millions)
            print(f"DeepSpeed wrote {ds_dir} in {time.perf_counter() - t0:.1f} s")
        tag = open(os.path.join(ds_dir, "latest")).read().strip()
        files = [os.path.join(ds_dir, tag, f) for f in sorted(os.listdir(os.path.join(ds_dir, tag)))]
        total = sum(os.path.getsize(f) for f in files)
        biggest = max(os.path.getsize(f) for f in files)
        py = sys.executable
        # torch.load(weights_only=False) needs DeepSpeed's classes importable: it runs under that interpreter
        ds_py = args.deepspeed_python or sys.executable
        _, floor_rss = _run_measured([py, "-c", "import torch, dscore.checkpoint.deepspeed; print(0.0)"])
        ds_imports = (
            "import deepspeed.runtime.fp16.loss_scaler, deepspeed.runtime.zero.config, deepspeed.utils.tensor_fragment"
        )
        _, ds_floor_rss = _run_measured([ds_py, "-c", f"import torch; {ds_imports}; print(0.0)"])
        floors = {"torch_load": ds_floor_rss, "import": floor_rss, "export": floor_rss}
        rows: dict[str, list[tuple[float, int]]] = {"torch_load": [], "import": [], "export": [], "engine": []}
        from dscore.checkpoint.deepspeed import DeepSpeedCheckpoint

        info = DeepSpeedCheckpoint(ds_dir).describe()
        shapes = [p.shape for p in DeepSpeedCheckpoint(ds_dir).params]
        env = dict(os.environ, BENCH_WIDTH=str(shapes[0][0]), BENCH_LAYERS=str(len(shapes) // 2), OMP_NUM_THREADS="1")
        for rep in range(args.repeats):
            for mode in rows:
                dst = os.path.join(root, f"{mode}-{rep}" + (".safetensors" if mode == "export" else ""))
                interp = ds_py if mode == "torch_load" else py
                rows[mode].append(_run_measured([interp, "-c", _MEASURE, mode, ds_dir, dst], env=env))
                if mode == "engine":
                    floors["engine"] = _FLOORS["engine"]
                if mode == "import":
                    shutil.rmtree(dst, ignore_errors=True)
                elif mode == "export" and os.path.exists(dst):
                    os.unlink(dst)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    mib = 2**20
    print(
        f"DeepSpeed checkpoint: ZeRO-{info['zero_stage']}, {info['world_size']} ranks, {info['elements'] / 1e6:.1f} M "
        f"parameters, {len(files)} files, {total / mib:.0f} MiB (largest file {biggest / mib:.0f} MiB)"
    )
    print(
        f"each run in a fresh process; median of {args.repeats}; process floors: python+torch+dscore "
        f"{floor_rss / mib:.0f} MiB, python+torch+deepspeed classes (torch.load side) {ds_floor_rss / mib:.0f} MiB RSS"
    )
    med = {k: (statistics.median(t for t, _ in v), statistics.median(r for _, r in v)) for k, v in rows.items()}
    base_t, base_r = med["torch_load"]
    base_above = max(1, base_r - floors["torch_load"])
    labels = {
        "torch_load": "torch.load(weights_only=False) of all files",
        "import": "dscore checkpoint import (safe, streamed)",
        "export": "dscore checkpoint export --fp32 (streamed)",
        "engine": "engine.load_checkpoint (1 rank, ZeRO-2 engine)",
    }
    for k, (t, r) in med.items():
        print(
            f"  {labels[k]:<46} {t:6.2f} s ({t / base_t:4.2f}x)   peak RSS {r / mib:6.0f} MiB, "
            f"{(r - floors[k]) / mib:6.0f} MiB above its floor ({(r - floors[k]) / base_above:4.2f}x)"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params-millions", type=float, default=25.0, help="model size in millions of parameters")
    parser.add_argument("--repeats", type=int, default=5, help="timed repetitions per variant (median reported)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--deepspeed", action="store_true", help="benchmark reading a DeepSpeed ZeRO-2 checkpoint")
    parser.add_argument("--deepspeed-python", default=None, help="interpreter that can import deepspeed (generation)")
    parser.add_argument("--deepspeed-dir", default=None, help="an existing DeepSpeed save directory to measure")
    args = parser.parse_args(argv)
    if args.deepspeed or args.deepspeed_dir or args.deepspeed_python:
        return deepspeed_bench(args)

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
