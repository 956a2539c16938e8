"""Stage-3 step time with and without the released-parameter guard (:mod:`dscore.zero.released`).

``--toggle``: one 2-rank job alternating blocks of steps with the guard on and switched off in-process (the
robust number on a loaded machine: both modes share the process, the model and the load); prints the median
step of each mode, their ratio and the marking calls per step.

The guard swaps a partitioned parameter's class on every gather and release; this measures what that
costs a ZeRO-3 training step. Each round runs one 2-rank gloo job (``dscore.testing.run_distributed``)
that trains a deep, narrow MLP (many small units: the worst case for per-unit overhead) and reports the
median step time; rounds alternate between this checkout and a baseline tree (``--baseline DIR``, e.g.
``git archive main | tar -x -C DIR``) imported first through ``PYTHONPATH``, so machine noise hits both.
The reported ratio is ``median(guard step) / median(baseline step)`` (1.0 = no cost).

Usage::

    python bench/zero3_released_guard.py --baseline /tmp/zmain [--rounds 4] [--steps 40] [--depth 24]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch


def _job(depth: int, hidden: int, steps: int, toggle: bool) -> dict[str, Any]:
    import torch.distributed as dist

    import dscore
    import dscore.zero.partition as partition

    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = dscore.initialize(model=model, model_parameters=model.parameters(), config=config)
    x = torch.randn(8, hidden, generator=torch.Generator().manual_seed(dist.get_rank()))
    guard = getattr(partition, "mark_released", None), getattr(partition, "mark_available", None)
    swaps = [0]

    def off(p: torch.Tensor) -> None:
        return None

    def counting(fn: Any) -> Any:
        def wrapped(p: torch.Tensor) -> None:
            swaps[0] += 1
            fn(p)

        return wrapped

    def step() -> float:
        t0 = time.perf_counter()
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        return time.perf_counter() - t0

    for _ in range(5):
        step()
    times: dict[str, list[float]] = {"guard": [], "off": []}
    block = 4
    for i in range(steps // block):
        # in-process A/B: blocks of steps alternate between the guard and the guard switched off (the
        # partition module's two marking functions replaced by a no-op), so load on a shared machine hits both
        mode = "off" if (toggle and i % 2) else "guard"
        if toggle:
            partition.mark_released, partition.mark_available = (off, off) if mode == "off" else guard
            for p in engine.module.parameters():  # every parameter's class as the mode would have left it
                u = partition.unit_of(p)
                if guard[0] is not None and u is not None:
                    (guard[0] if mode == "guard" and not u.gathered else guard[1])(p)
        times[mode] += [step() for _ in range(block)]
    if toggle and guard[0] is not None:
        partition.mark_released, partition.mark_available = counting(guard[0]), counting(guard[1])
        step()
        partition.mark_released, partition.mark_available = guard
    out: dict[str, Any] = {k: statistics.median(v) for k, v in times.items() if v}
    out["marks_per_step"] = swaps[0]
    out["file"] = partition.__file__
    return out


def _one(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    from dscore.testing import run_distributed

    r0, _ = run_distributed(_job, 2, args.depth, args.hidden, args.steps, args.toggle, timeout=600)
    if args.toggle:
        print(f"stage-3 step (depth {args.depth}, hidden {args.hidden}, 2 gloo ranks, in-process A/B): guard "
              f"{r0['guard'] * 1e3:.3f} ms, guard off {r0['off'] * 1e3:.3f} ms, ratio {r0['guard'] / r0['off']:.4f}, "
              f"{r0['marks_per_step']} marking calls per step")
    print(json.dumps(r0))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", help="tree imported first for the baseline rounds")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--depth", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--toggle", action="store_true", help="in-process A/B only (guard on/off), no baseline tree")
    args = ap.parse_args()
    if args.one or args.toggle:
        _one(args)
        return
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, os.path.abspath(__file__), "--one", "--steps", str(args.steps),
           "--depth", str(args.depth), "--hidden", str(args.hidden)]
    res: dict[str, list[float]] = {"guard": [], "baseline": []}
    for _ in range(args.rounds):
        for label, tree in (("baseline", args.baseline), ("guard", here)):
            env = dict(os.environ, PYTHONPATH=f"{tree}:{tree}/plugins")
            out = subprocess.run(cmd, env=env, cwd="/tmp", capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            assert r["file"].startswith(tree), (label, r["file"])
            res[label].append(r["guard"])
    g, b = statistics.median(res["guard"]), statistics.median(res["baseline"])
    print(f"stage-3 step (depth {args.depth}, hidden {args.hidden}, 2 gloo ranks): guard {g * 1e3:.2f} ms, "
          f"baseline {b * 1e3:.2f} ms, ratio {g / b:.3f}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
