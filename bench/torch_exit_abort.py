"""Plain torch, no dscore: the exit abort that ``dscore.comm.exit_drain`` works around (issue 27 item 5).

Each run starts two gloo ranks on loopback that leave ``--count`` async all-reduces of temporary tensors in
flight and exit, either without ``destroy_process_group`` (``--mode none``, what user code often does) or
with it in an ``atexit`` hook (``--mode destroy``). A rank whose gloo worker drops a finished collective
while the interpreter finalizes aborts: ``terminate called without an active exception``, exit 134.

Usage: ``python bench/torch_exit_abort.py --runs 10 --mode none`` (2026-12-01, torch 2.13 CPU, Python 3.11,
loaded 2-core machine: ``none`` 9 of 10 runs aborted, ``destroy`` 0 of 10). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys

CHILD = """
import sys, atexit, torch, torch.distributed as dist
rank, port, mode, count = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
for _ in range(count):
    dist.all_reduce(torch.ones(1 << 14, device="cpu"), async_op=True)
if mode == "destroy":
    atexit.register(dist.destroy_process_group)
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--mode", choices=["none", "destroy"], default="none")
    p.add_argument("--count", type=int, default=20)
    a = p.parse_args()
    aborts = 0
    for _ in range(a.runs):
        port = str(random.randint(20000, 59999))
        procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(r), port, a.mode, str(a.count)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
        results = [(proc.wait(timeout=300), proc.stderr.read() if proc.stderr else "") for proc in procs]
        if any(rc == 134 or rc == -6 or "terminate called" in err for rc, err in results):
            aborts += 1
    print(json.dumps({"mode": a.mode, "runs": a.runs, "count": a.count, "aborts": aborts}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
