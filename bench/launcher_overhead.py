"""Launcher overhead: an empty 2-process job through ``dscore run`` vs ``torchrun --nproc_per_node 2``.

Rounds alternate between the two launchers (so machine load affects both alike); each side's wall time
is the median of its rounds; the ratio dscore/torchrun is printed (target: <= 1.2; DeepSpeed's launcher
measured 2.5x). The job script is empty, so the numbers are the launchers' own cost: interpreter and
import start-up, spawning, waiting and exit. After the runs, leftover files in /dev/shm and surviving
children are reported.

Usage: ``python bench/launcher_overhead.py [--rounds 7]``
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def timed(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="rounds per launcher (default 7)")
    args = parser.parse_args()
    bindir = os.path.dirname(sys.executable)
    torchrun = shutil.which("torchrun", path=bindir) or shutil.which("torchrun")
    dscore = shutil.which("dscore", path=bindir)
    dscore_argv = [dscore] if dscore else [sys.executable, "-m", "dscore"]
    torchrun_argv = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "empty.py")
        with open(script, "w") as fh:
            fh.write("")
        env_note = "DS_ACCELERATOR unset; --num_gpus 2 (no device probing)"
        times: dict[str, list[float]] = {"dscore run": [], "torchrun": []}
        timed([*dscore_argv, "run", "-q", "--num_gpus", "2", script])  # warm the page cache for both
        timed([*torchrun_argv, "--nproc_per_node", "2", "--master_port", str(free_port()), script])
        dscore_shm: set[str] = set()
        for _ in range(args.rounds):
            before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
            times["dscore run"].append(
                timed([*dscore_argv, "run", "-q", "--num_gpus", "2", "--master_port", str(free_port()), script])
            )
            after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
            dscore_shm |= after - before
            times["torchrun"].append(
                timed([*torchrun_argv, "--nproc_per_node", "2", "--master_port", str(free_port()), script])
            )
    medians = {k: statistics.median(v) for k, v in times.items()}
    for name, values in times.items():
        print(f"{name:>10}: median {medians[name]:.3f} s  rounds {' '.join(f'{v:.3f}' for v in values)}")
    ratio = medians["dscore run"] / medians["torchrun"]
    print(f"({env_note})")
    print(f"ratio dscore run / torchrun = {ratio:.2f}  (target <= 1.2)")
    shm_after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    print(f"new files in /dev/shm during dscore rounds: {sorted(dscore_shm) or 'none'}")
    print(
        f"new files in /dev/shm during the whole run (any process on the machine): {sorted(shm_after - shm_before) or 'none'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
