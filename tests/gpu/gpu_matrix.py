"""The issue-28 matrix on a real GPU (CUDA + NCCL, world size 1), the fused optimizers against torch and
their HBM roofline; prints one summary table. Run through ``tests/gpu/run.sh``.

Checks (one row each):

* ``accelerator``: tests/gpu/check_cuda_accelerator.py (the cuda accelerator and a 1-rank nccl init);
* ``fused <op> [dtype]``: tests/gpu/check_fused_ops.py — FusedAdam/FusedLamb/FusedLion against torch's
  optimizers or a plain-torch reference, FusedLamb bit-identical across two runs (deterministic norms);
* ``roofline <op>``: effective bytes/s of each fused step on 64M fp32 parameters against this GPU's
  measured device-to-device copy bandwidth (the achievable HBM roofline), as a fraction;
* ``matrix <cell>``: tests/testdevice/testdevice_matrix.py's cells — ZeRO 0-3 x fp32/bf16/fp16, optimizer
  offload (cpu), parameter offload, accumulation, clipping, fp16 overflow, save -> load at another stage,
  GatheredParameters + activation checkpointing, a DeepSpeed checkpoint, the GPT example — on cuda/nccl
  against the same cell on the CPU (gloo) and against the plain-PyTorch reference. Differences between
  cuda and cpu kernels are expected in the last bits, so the bounds are: fp32 1e-4, fp16 1e-3 with the
  same skipped steps and loss scales, bf16 2e-2; the masters must be fp32 and the 2-stage pipeline needs
  two GPUs (skipped at world size 1).

``--dry-run-on-testdev`` runs only the matrix section with the test device in place of CUDA (a check of
this script on machines without a GPU).

Exit status: 0 all passed (or no CUDA device: every row SKIP), 1 a check failed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "testdevice"))
ROWS: list[tuple[str, str, str]] = []


def row(name: str, ok: bool | None, detail: str = "") -> None:
    ROWS.append((name, "SKIP" if ok is None else ("PASS" if ok else "FAIL"), detail))
    print(f"{ROWS[-1][1]} {name} {detail}", flush=True)


def run_script(name: str, args: list[str], timeout: int) -> None:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith(("PASS ", "FAIL ", "BENCH ")):
            kind, _, rest = line.partition(" ")
            if kind == "BENCH":
                continue
            row(f"{name}: {rest.split(':')[0][:60]}", kind == "PASS", rest[60:120])
    if proc.returncode not in (0, 1):
        row(name, False, f"exit {proc.returncode}: {proc.stderr[-300:]}")
    print(f"# {name}: {time.perf_counter() - start:.0f} s", flush=True)


def roofline() -> None:
    import torch

    from dscore_plugins.ops.fused_optim import FusedAdam, FusedLamb, FusedLion

    n = 64 * 2**20
    src = torch.empty(n * 4, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        dst.copy_(src)
    torch.cuda.synchronize()
    copy_bw = 2 * src.numel() * 20 / (time.perf_counter() - t0)  # read + write bytes per second
    del src, dst
    row("roofline: device copy", True, f"{copy_bw / 1e9:.0f} GB/s (read+write)")
    # bytes moved per fp32 element by one step: Adam r p,g,m,v w p,m,v; LAMB two passes (r p,g,m,v w m,v;
    # r p,m,v w p); Lion r p,g,m w p,m
    for name, make, per_elem in (
        ("FusedAdam", lambda ps: FusedAdam(ps, lr=1e-4), 28),
        ("FusedLamb", lambda ps: FusedLamb(ps, lr=1e-4), 40),
        ("FusedLion", lambda ps: FusedLion(ps, lr=1e-5), 20),
    ):
        params = [torch.randn(n // 8, device="cuda") for _ in range(8)]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = make(params)
        for _ in range(3):
            opt.step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            opt.step()
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / 10
        bw = per_elem * n / dt
        frac = bw / copy_bw
        row(f"roofline: {name}", frac >= 0.5, f"{dt * 1e3:.2f} ms/step, {bw / 1e9:.0f} GB/s = {frac:.2f} of copy")
        del params, opt
        torch.cuda.empty_cache()


def matrix(platform: str = "cuda") -> None:
    import numpy as np
    import testdevice_matrix as tm
    import testdevice_reference as ref

    from dscore.testing import run_distributed

    with tempfile.TemporaryDirectory() as tmp:
        cells: list[dict[str, Any]] = [{"stage": s, "precision": p} for s in (0, 1, 2, 3) for p in ("fp32", "bf16", "fp16")]
        cells += [{"stage": s, "precision": p, "offload": "cpu"} for s in (1, 2, 3) for p in ("fp32", "bf16")]
        cells += [
            {"stage": 3, "precision": "fp32", "offload": "cpu", "param_offload": True},
            {"stage": 2, "precision": "fp32", "gas": 1, "clip": False},
            *({"stage": s, "precision": "fp16", "steps": 5, "spike": True} for s in (1, 2, 3)),
            {"kind": "save", "stage": 2, "precision": "fp32", "offload": "cpu", "dir": f"{tmp}/s"},
            {"kind": "gathered", "stage": 3, "precision": "fp32"},
            {"kind": "gpt", "stage": 2, "precision": "fp32"},
            {"kind": "ds_resume", "stage": 3, "precision": "fp32", "fixture": "tied_z2_ws2"},
        ]
        start = time.perf_counter()
        out = run_distributed(tm.run_matrix, 1, cells, (platform, "cpu"), init_process_group=False, timeout=420)[0]
        resume = [{"kind": "resume", "stage": 3, "precision": "fp32", "dir": f"{tmp}/s"}]
        back = run_distributed(tm.run_matrix, 1, resume, (platform, "cpu"), init_process_group=False, timeout=200)[0]
    print(f"# matrix: {time.perf_counter() - start:.0f} s", flush=True)
    row("matrix: pipeline (2 stages)", None, "needs 2 GPUs; runs on the test device in CI")
    tol = {"fp32": 1e-4, "fp16": 1e-3, "bf16": 2e-2}
    for cell, gpu, cpu in [*zip(cells, out[platform], out["cpu"]), *zip(resume, back[platform], back["cpu"])]:
        name = "matrix: " + ",".join(f"{k}={v}" for k, v in cell.items() if k != "dir")
        if isinstance(gpu, str) or isinstance(cpu, str):
            row(name, False, (gpu if isinstance(gpu, str) else cpu).strip().splitlines()[-1][:200])
            continue
        if "errors" in gpu:
            worst = max(gpu["errors"].values())
            row(name, worst < 1e-4, f"max |w - DeepSpeed| {worst:.2e}")
            continue
        if "params" not in gpu:
            row(name, True, "")
            continue
        diff = max(float(np.abs(gpu["params"][k] - cpu["params"][k]).max()) for k in gpu["params"])
        ok = diff <= tol[cell["precision"]]
        detail = f"max |cuda - cpu| {diff:.2e}"
        if gpu.get("applied") is not None and gpu.get("applied") != cpu.get("applied"):
            ok, detail = False, f"{detail}; skipped steps differ {gpu['applied']} vs {cpu['applied']}"
        if gpu.get("scales") is not None and gpu.get("scales") != cpu.get("scales"):
            ok, detail = False, f"{detail}; loss scales differ {gpu['scales']} vs {cpu['scales']}"
        masters = gpu.get("masters")
        if isinstance(masters, list) and any(dtype != "torch.float32" for dtype, _ in masters):
            ok, detail = False, f"{detail}; masters {masters}"
        if cell.get("kind", "train") == "train" and not cell.get("param_offload"):
            want = ref.reference(cell, world=1)
            rd = max(float(np.abs(gpu["params"][k] - want["params"][k]).max()) for k in want["params"])
            ok = ok and rd <= tol[cell["precision"]] and (not cell.get("spike") or gpu["applied"] == want["applied"])
            detail += f", |cuda - torch ref| {rd:.2e}"
        row(name, ok, detail)


def main() -> int:
    import torch

    if "--dry-run-on-testdev" in sys.argv:  # exercise the matrix section on the test device (no GPU needed)
        matrix("testdev")
        print_table()
        return 0 if all(r[1] != "FAIL" for r in ROWS) else 1
    if not torch.cuda.is_available():
        row("all", None, f"no CUDA device (torch {torch.__version__}, cuda build: {torch.version.cuda}); nothing checked")
        print_table()
        return 0
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(tempfile.gettempdir()) / "dscore-gpu-ops"))
    run_script("accelerator", ["tests/gpu/check_cuda_accelerator.py"], 300)
    run_script("fused", ["tests/gpu/check_fused_ops.py", "--steps", "20"], 420)
    for section in (roofline, matrix):
        try:
            section()
        except Exception as exc:  # report and go on: one table for everything
            row(section.__name__, False, f"{type(exc).__name__}: {str(exc)[:300]}")
    print_table()
    return 0 if all(r[1] != "FAIL" for r in ROWS) else 1


def print_table() -> None:
    width = max(len(n) for n, _, _ in ROWS)
    print("\n" + "=" * (width + 60))
    print(f"{'check'.ljust(width)}  result  detail")
    for name, result, detail in ROWS:
        print(f"{name.ljust(width)}  {result:6}  {detail}")
    fails = sum(r[1] == "FAIL" for r in ROWS)
    print(f"{len(ROWS)} checks: {sum(r[1] == 'PASS' for r in ROWS)} passed, {fails} failed, "
          f"{sum(r[1] == 'SKIP' for r in ROWS)} skipped")


if __name__ == "__main__":
    sys.exit(main())
