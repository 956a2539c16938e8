"""Stage-3 step time with and without the released-parameter guard (:mod:`dscore.zero.released`).

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


def _job(depth: int, hidden: int, steps: int) -> dict[str, Any]:
    import torch.distributed as dist

    import dscore

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
    times = []
    for i in range(steps + 5):
        t0 = time.perf_counter()
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        if i >= 5:
            times.append(time.perf_counter() - t0)
    return {"median_step_s": statistics.median(times), "file": dscore.zero.partition.__file__}


def _one(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    from dscore.testing import run_distributed

    r0, _ = run_distributed(_job, 2, args.depth, args.hidden, args.steps, timeout=600)
    print(json.dumps(r0))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", help="tree imported first for the baseline rounds")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--depth", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
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
            res[label].append(r["median_step_s"])
    g, b = statistics.median(res["guard"]), statistics.median(res["baseline"])
    print(f"stage-3 step (depth {args.depth}, hidden {args.hidden}, 2 gloo ranks): guard {g * 1e3:.2f} ms, "
          f"baseline {b * 1e3:.2f} ms, ratio {g / b:.3f}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
