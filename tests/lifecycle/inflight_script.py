"""A 2-rank job for the clean-exit tests (run through ``dscore run``; not a test module).

The user creates the process group, dscore adopts it (``dscore.init_distributed``), and the user leaves
async all-reduces of temporary tensors in flight and exits **without destroying the group** (common user
code). Rank 1 launches its part ``--peer_delay`` seconds late, so rank 0's gloo workers sit blocked on the
peer (asleep, using no CPU) while rank 0 reaches its exit; an object of rank 0's ``__main__`` takes
``--slow_finalizer`` seconds to finalize, so rank 0 is still finalizing when rank 1 arrives and the workers
finish and drop the temporaries. Plain torch then aborts every time (``terminate called without an active
exception``, see ``dscore.comm.exit_drain``); dscore's exit hook must let the workers finish and park
first. ``--no_dscore`` runs the same without dscore.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--local_rank", type=int, default=-1)
p.add_argument("--peer_delay", type=float, default=0.0)
p.add_argument("--count", type=int, default=20)
p.add_argument("--slow_finalizer", type=float, default=1.0)
p.add_argument("--no_dscore", action="store_true")
args = p.parse_args()
torch.set_num_threads(1)

dist.init_process_group("gloo")
if not args.no_dscore:
    import dscore

    dscore.init_distributed()
dist.barrier()
if dist.get_rank() == 1:
    time.sleep(args.peer_delay)


class SlowFinalizer:
    def __del__(self, _sleep=time.sleep, _seconds=args.slow_finalizer) -> None:  # bound now: globals go first
        _sleep(_seconds)  # releases the GIL while the interpreter finalizes


slow = SlowFinalizer()
for _ in range(args.count):
    dist.all_reduce(torch.ones(1 << 14, device="cpu"), async_op=True)  # nobody keeps the work or the tensor
