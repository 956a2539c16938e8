"""Benchmark: the async_io op (libaio, O_DIRECT) vs ``dd`` with ``oflag=direct`` / ``iflag=direct``.

Setup: one file of ``--size-mib`` MiB (default 512) in ``--dir`` (default: a temporary folder under
``$TMPDIR``/``/tmp``). Each round runs, alternately:

* ``dd write``  ``dd if=/dev/zero of=F bs=<block> count=N oflag=direct`` (file removed first)
* ``op write``  ``AsyncIOHandle.sync_pwrite`` of a 4096-aligned tensor of the same size (file removed first)
* ``dd read``   ``dd if=F of=/dev/null bs=<block> iflag=direct``
* ``op read``   ``AsyncIOHandle.sync_pread`` into a 4096-aligned tensor

Both bypass the page cache, so the figures are the device's, not memory's. The handle uses the ``aio``
settings given (``--block-size`` 1 MiB, ``--queue-depth`` 8, ``--threads`` 1: DeepSpeed 0.19.8's defaults);
``dd`` uses the same block size with one request in flight. Printed: the median GB/s (1e9 bytes/s) of each
and the best GB/s of each over ``--rounds`` rounds, and the op/dd ratios (target >= 0.9 on the medians; the
best-of figures show the device's capability when the machine is loaded). dd's time is the wall time of the process
(a few ms of process start on hundreds of MiB). On a shared machine compare ratios, not absolute figures.

Second part (skip with ``--no-offload``): ZeRO stage 2 on one rank with the optimizer offloaded to ``cpu``
and to ``nvme`` (swap files in the same folder; ``sub_group_size`` 1M elements, ``reduce_bucket_size``
4M, ``pipeline_read`` and ``pipeline_write``, ``buffer_count`` 4; the glibc policy NVMe offload applies,
:func:`dscore_plugins.zero.stage3.apply_host_malloc_policy`, in both), for a stack of ``--layers`` Linear(``--hidden``) layers trained
with AdamW on a micro-batch of 4 rows, so the optimizer state (fp32 master, exp_avg, exp_avg_sq: 12
bytes per parameter) dominates memory. Each mode runs in a fresh process: one warm-up step (creates the
state), then the peak-RSS counter is reset (``/proc/self/clear_refs``) and ``--steps`` steps are timed.
Printed: median step time, peak RSS over those steps and RSS after them of each, the nvme/cpu ratios (RSS well below 1
is the point of NVMe offload), and whether both ended with bit-identical weights.

Usage: ``python bench/aio.py --size-mib 512 --rounds 5``
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time

import torch


def _dd(args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(["dd", *args, "status=none"], check=True)
    return time.perf_counter() - start


def run(size_mib: int, rounds: int, folder: str, block_size: int, queue_depth: int, threads: int) -> dict[str, float]:
    """Run the benchmark; returns median seconds per variant and the derived GB/s and ratios."""
    from dscore_plugins.ops.aio import AsyncIOHandle, aligned_empty

    nbytes = size_mib << 20
    if nbytes % block_size:
        raise SystemExit(f"--size-mib must be a multiple of the block size ({block_size} bytes)")
    count = nbytes // block_size
    path = os.path.join(folder, "dscore_aio_bench.swp")
    buf = aligned_empty(nbytes, torch.uint8)
    buf.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)))
    back = aligned_empty(nbytes, torch.uint8)
    times: dict[str, list[float]] = {"dd_write": [], "op_write": [], "dd_read": [], "op_read": []}
    with AsyncIOHandle(block_size=block_size, queue_depth=queue_depth, intra_op_parallelism=threads) as h:
        h.sync_pwrite(buf[: 1 << 20], path)  # warm-up (threads, kernel AIO context)
        for _ in range(rounds):
            os.unlink(path)
            times["dd_write"].append(_dd(["if=/dev/zero", f"of={path}", f"bs={block_size}", f"count={count}", "oflag=direct"]))
            os.unlink(path)
            start = time.perf_counter()
            h.sync_pwrite(buf, path)
            times["op_write"].append(time.perf_counter() - start)
            times["dd_read"].append(_dd([f"if={path}", "of=/dev/null", f"bs={block_size}", "iflag=direct"]))
            back.zero_()
            start = time.perf_counter()
            h.sync_pread(back, path)
            times["op_read"].append(time.perf_counter() - start)
            if not torch.equal(back, buf):
                raise SystemExit("the op read back different bytes than it wrote")
        direct = h.direct_requests
    os.unlink(path)
    med = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}
    out: dict[str, float] = {f"{k}_s": v for k, v in med.items()}
    for k, v in med.items():
        out[f"{k}_gbps"] = nbytes / v / 1e9
        out[f"{k}_best_gbps"] = nbytes / best[k] / 1e9
    for kind in ("write", "read"):
        out[f"{kind}_ratio"] = med[f"dd_{kind}"] / med[f"op_{kind}"]
        out[f"{kind}_best_ratio"] = best[f"dd_{kind}"] / best[f"op_{kind}"]
    out["direct_requests"] = direct
    return out


_OFFLOAD_CHILD = r"""
import hashlib, json, os, statistics, sys, time
import torch
import dscore
from dscore_plugins.zero.stage3 import apply_host_malloc_policy

apply_host_malloc_policy()  # what NVMe offload applies; here for both modes, so only the state differs
mode, folder, hidden, layers, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
stage = int(sys.argv[6])
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden) for _ in range(layers)])
offload = {"device": "cpu"}
if mode != "cpu":
    offload = {"device": "nvme", "nvme_path": folder, "pipeline_read": True, "pipeline_write": True, "buffer_count": 4}
zero = {"stage": stage, "offload_optimizer": offload, "sub_group_size": 1_000_000, "reduce_bucket_size": 4_000_000}
if stage == 3:  # parameters offloaded too: to the host, or (nvme) to swap files with 2 layers' worth resident
    zero["offload_param"] = {"device": "cpu"} if mode == "cpu" else {
        "device": "nvme", "nvme_path": folder, "max_in_cpu": 2 * (hidden * hidden + hidden), "buffer_count": 2}
cfg = {
    "train_micro_batch_size_per_gpu": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    "zero_optimization": zero,
}
engine, *_ = dscore.initialize(model=model, config=cfg)
x = torch.randn(4, hidden, generator=torch.Generator().manual_seed(1))


def step():
    engine.backward(engine(x).pow(2).mean())
    engine.step()


step()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak-RSS counter (VmHWM) to the current RSS
times = []
for _ in range(steps):
    t0 = time.perf_counter()
    step()
    times.append(time.perf_counter() - t0)
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
rss = int(status["VmRSS"].split()[0]) * 1024
weights = engine.module_state_dict()  # gathered (stage 3 releases the module's own parameters)
digest = hashlib.sha256(b"".join(v.float().numpy().tobytes() for v in weights.values())).hexdigest()
params = sum(v.numel() for v in weights.values())
engine.close()
print(json.dumps({"step_s": statistics.median(times), "peak_rss": int(status["VmHWM"].split()[0]) * 1024, "rss": rss,
                  "params": params, "digest": digest}))
"""


def run_offload(folder: str, hidden: int, layers: int, steps: int, stage: int = 2) -> dict[str, dict[str, float]]:
    """Step time and peak RSS of ZeRO optimizer offload to cpu and to nvme (one fresh process each); at
    stage 3 the parameters are offloaded as well (cpu, nvme)."""
    import json
    import sys

    from dscore.testing import find_free_port

    out: dict[str, dict[str, float]] = {}
    for mode in ("cpu", "nvme"):
        env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_port()),
                   DSCORE_SWAP_INDEX=os.path.join(folder, "swap_index"))  # keep the user's index clean
        proc = subprocess.run([sys.executable, "-c", _OFFLOAD_CHILD, mode, folder, str(hidden), str(layers), str(steps),
                               str(stage)],
                              env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"offload benchmark ({mode}) failed:\n{proc.stderr[-3000:]}")
        out[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None, help="folder on the device to measure (default: a temp folder)")
    parser.add_argument("--block-size", type=int, default=1048576)
    parser.add_argument("--queue-depth", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="aio intra_op_parallelism")
    parser.add_argument("--no-offload", action="store_true", help="skip the ZeRO offload cpu-vs-nvme part")
    parser.add_argument("--hidden", type=int, default=2048, help="offload part: width of each Linear layer")
    parser.add_argument("--layers", type=int, default=8, help="offload part: number of Linear layers")
    parser.add_argument("--steps", type=int, default=5, help="offload part: timed steps per mode")
    parser.add_argument("--stage", type=int, default=2, choices=(1, 2, 3),
                        help="offload part: ZeRO stage (3: parameters offloaded too, cpu vs nvme)")
    args = parser.parse_args()
    folder = args.dir or tempfile.mkdtemp(prefix="dscore_aio_bench_")
    try:
        r = run(args.size_mib, args.rounds, folder, args.block_size, args.queue_depth, args.threads)
        off = None if args.no_offload else run_offload(folder, args.hidden, args.layers, args.steps, args.stage)
    finally:
        if args.dir is None:
            shutil.rmtree(folder, ignore_errors=True)
    print(f"file {args.size_mib} MiB in {folder}; block {args.block_size} B, queue_depth {args.queue_depth}, "
          f"threads {args.threads}; median of {args.rounds} rounds")
    print(f"{'':14}{'dd (direct)':>14}{'async_io':>12}{'op/dd':>8}")
    for kind in ("write", "read"):
        for label, suffix in (("median", ""), ("best", "_best")):
            print(f"{kind + ' ' + label:14}{r[f'dd_{kind}{suffix}_gbps']:>10.2f} GB/s"
                  f"{r[f'op_{kind}{suffix}_gbps']:>8.2f} GB/s{r[f'{kind}{suffix}_ratio']:>7.2f}x"
                  + ("  (target >= 0.90x)" if not suffix else ""))

    if off is None:
        return
    cpu, nvme = off["cpu"], off["nvme"]
    what = "optimizer and parameter" if args.stage == 3 else "optimizer"
    print(f"\nZeRO-{args.stage} {what} offload, {cpu['params'] / 1e6:.1f}M parameters (AdamW), median of {args.steps} steps")
    print(f"{'':14}{'cpu':>12}{'nvme':>12}{'nvme/cpu':>10}")
    print(f"{'step time':14}{cpu['step_s']:>10.3f} s{nvme['step_s']:>10.3f} s{nvme['step_s'] / cpu['step_s']:>9.2f}x")
    for key, label in (("peak_rss", "peak RSS"), ("rss", "RSS after")):
        print(f"{label:14}{cpu[key] / 2**20:>8.0f} MiB{nvme[key] / 2**20:>8.0f} MiB{nvme[key] / cpu[key]:>9.2f}x")
    print(f"weights after {args.steps + 1} steps bit-identical: {'yes' if cpu['digest'] == nvme['digest'] else 'NO'}")


if __name__ == "__main__":
    main()
