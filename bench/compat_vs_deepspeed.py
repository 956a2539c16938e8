"""Per-step losses of the unchanged Hugging Face Trainer and Accelerate loop: dscore (through compat/deepspeed)
vs DeepSpeed 0.19.8, side by side.

The same jobs as ``tests/compat`` (``tests/compat/hf_jobs.py``: a tiny GPT-2 from a config, token-id tensors,
fp32, 2 gloo ranks on CPU, ``TrainingArguments(deepspeed=cfg, use_cpu=True)``) run once in this interpreter
(dscore's venv, where ``deepspeed`` is dscore's compatibility layer) and once in ``--deepspeed-python``, an
interpreter with DeepSpeed 0.19.8, transformers and accelerate (``DS_ACCELERATOR=cpu``). Prints one table per
job with the losses of every step, the absolute difference, and the largest difference; exits 1 when a
difference exceeds ``--tol`` (default 1e-5) or either side is not what it should be (the peer must be real
DeepSpeed, this side dscore's layer).

Usage: ``python bench/compat_vs_deepspeed.py --deepspeed-python /work/venv-ds/bin/python [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
JOBS = ROOT / "tests" / "compat"


def _child(out: str) -> int:
    """Run every job here on 2 ranks and write ``{job: {rank: result}}`` as JSON to ``out``."""
    sys.path.insert(0, str(JOBS))
    import hf_jobs

    from dscore.testing import run_distributed

    results: dict[str, Any] = {}
    for stage in (2, 3):
        with tempfile.TemporaryDirectory() as tmp:
            res = run_distributed(hf_jobs.trainer_run, 2, stage, tmp, timeout=900, init_process_group=False)
        results[f"trainer_zero{stage}"] = {"losses": res[0]["losses"], "grad_norms": res[0]["grad_norms"],
                                           "deepspeed": res[0]["deepspeed"], "engine": res[0]["engine"]}
    with tempfile.TemporaryDirectory() as tmp:  # optimizer and WarmupDecayLR from the config ("auto")
        res = run_distributed(hf_jobs.trainer_run, 2, 2, tmp, 10, 5, None, False, True, timeout=900,
                              init_process_group=False)
    results["trainer_zero2_config_optimizer_scheduler"] = {
        "losses": res[0]["losses"], "grad_norms": res[0]["grad_norms"], "deepspeed": res[0]["deepspeed"],
        "engine": res[0]["engine"]}
    for stage in (2, 3):  # one job per stage: DeepSpeed keeps its groups in globals across engines
        acc = run_distributed(hf_jobs.accelerate_run, 2, stage, timeout=900, init_process_group=False)
        for rank in (0, 1):
            r = acc[rank]
            results[f"accelerate_zero{stage}_rank{rank}"] = {
                "losses": {i + 1: x for i, x in enumerate(r["losses"])}, "engine": r["engine"],
                "deepspeed": results["trainer_zero2"]["deepspeed"],
            }
    Path(out).write_text(json.dumps(results))
    return 0


def _run_side(python: str, env_extra: dict[str, str]) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    env = {**os.environ, **env_extra, "PYTHONPATH": os.pathsep.join([str(JOBS), os.environ.get("PYTHONPATH", "")])}
    t0 = time.perf_counter()
    proc = subprocess.run([python, str(Path(__file__).resolve()), "--child", out], env=env, cwd=str(ROOT),
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise SystemExit(f"{python}: the jobs failed (exit {proc.returncode})")
    data = json.loads(Path(out).read_text())
    os.unlink(out)
    print(f"{python}: jobs done in {time.perf_counter() - t0:.0f} s", flush=True)
    return data


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deepspeed-python", default="/work/venv-ds/bin/python")
    ap.add_argument("--tol", type=float, default=1e-5)
    ap.add_argument("--json", default=None, help="write both sides' results here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return _child(args.child)

    dscore_side = _run_side(sys.executable, {})
    ds_side = _run_side(args.deepspeed_python, {"DS_ACCELERATOR": "cpu"})
    ok = True
    some = next(iter(dscore_side.values()))
    peer = next(iter(ds_side.values()))
    if "+dscore" not in some["deepspeed"] or "+dscore" in peer["deepspeed"]:
        print(f"not a side-by-side run: this side has deepspeed {some['deepspeed']}, the peer {peer['deepspeed']}")
        return 1
    print(f"dscore side: deepspeed {some['deepspeed']} ({some['engine']}); peer: DeepSpeed {peer['deepspeed']} "
          f"({peer['engine']})\n")
    worst_all = 0.0
    for job in dscore_side:
        mine, theirs = dscore_side[job]["losses"], ds_side[job]["losses"]
        print(f"### {job}\n\n| step | dscore | DeepSpeed 0.19.8 | abs diff |\n|---:|---:|---:|---:|")
        worst = 0.0
        for step in sorted(mine, key=int):
            a, b = float(mine[step]), float(theirs[str(step)] if str(step) in theirs else theirs[step])
            worst = max(worst, abs(a - b))
            print(f"| {step} | {a:.7f} | {b:.7f} | {abs(a - b):.1e} |")
        if sorted(mine, key=int) != sorted(theirs, key=int):
            print(f"steps differ: {sorted(mine)} vs {sorted(theirs)}")
            ok = False
        print(f"\nmax abs diff {worst:.2e} ({'ok' if worst <= args.tol else 'ABOVE ' + str(args.tol)})\n")
        ok = ok and worst <= args.tol
        worst_all = max(worst_all, worst)
    print(f"largest difference over all jobs: {worst_all:.2e} (tolerance {args.tol:g})")
    if args.json:
        Path(args.json).write_text(json.dumps({"dscore": dscore_side, "deepspeed": ds_side}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
