"""Torch-free rank used by the launcher tests (``dscore run ... worker.py <mode> <outdir> [args]``).

Every rank writes ``<outdir>/rank<R>.json`` (argv, launcher variables, pid) and then acts by mode:

* ``echo``: exit 0.
* ``fail``: rank 1 exits with code 3 once every rank has written its file; the others sleep (hang guard 120 s).
* ``selfkill``: rank 1 kills itself with SIGKILL once every rank is up; the others sleep.
* ``hold``: every rank starts two grandchildren (``sleep``; one in its process group, one in a new session
  via ``setsid``), records their pids and sleeps.
* ``stubborn``: like ``fail``, but the surviving ranks ignore SIGTERM.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

KEYS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_SIZE",
    "LOCAL_WORLD_SIZE",
    "CROSS_RANK",
    "CROSS_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "CUDA_VISIBLE_DEVICES",
    "HELLO",
    "EXTRA_FLAGS",
)


def wait_all(outdir: str, world: int) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if all(os.path.exists(os.path.join(outdir, f"rank{r}.json")) for r in range(world)):
            return
        time.sleep(0.02)
    sys.exit(99)


def main() -> None:
    args = sys.argv[1:]
    if args and args[0].startswith(("--local_rank=", "--local-rank=")):
        args = args[1:]
    mode, outdir, *rest = args
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    record = {"argv": sys.argv, "env": {k: os.environ.get(k) for k in KEYS}, "pid": os.getpid(), "children": []}
    if mode == "hold":
        in_group = subprocess.Popen(["sleep", "120"])
        escaped = subprocess.Popen(["sleep", "121"], start_new_session=True)
        record["children"] = [in_group.pid, escaped.pid]
    if mode == "stubborn" and rank != 1:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    tmp = os.path.join(outdir, f".rank{rank}.tmp")
    with open(tmp, "w") as fh:
        json.dump(record, fh)
    os.replace(tmp, os.path.join(outdir, f"rank{rank}.json"))
    if mode == "echo":
        return
    wait_all(outdir, world)
    if rank == 1 and mode in ("fail", "stubborn"):
        sys.exit(3)
    if rank == 1 and mode == "selfkill":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)


if __name__ == "__main__":
    main()
