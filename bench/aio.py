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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None, help="folder on the device to measure (default: a temp folder)")
    parser.add_argument("--block-size", type=int, default=1048576)
    parser.add_argument("--queue-depth", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="aio intra_op_parallelism")
    args = parser.parse_args()
    folder = args.dir or tempfile.mkdtemp(prefix="dscore_aio_bench_")
    try:
        r = run(args.size_mib, args.rounds, folder, args.block_size, args.queue_depth, args.threads)
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


if __name__ == "__main__":
    main()
