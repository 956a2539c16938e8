"""A 2-rank job for the clean-exit tests (run through ``dscore run``; not a test module).

Trains a tiny MLP a few steps at ZeRO stage ``--stage``, saves a checkpoint, then leaves collectives in
flight (async all-reduces nobody waits for) and an object whose finalizer takes a moment, and ends as
``--end`` says. Without dscore ending its process group before interpreter finalization, gloo's worker
threads then drop those collectives' tensors during finalization, need the GIL, are ended by
``pthread_exit`` through a ``noexcept`` frame, and the rank aborts (``terminate called without an active
exception``, SIGABRT, exit 134).

``--user_group``: the script creates the process group itself; its own atexit hook (registered before
dscore is imported, or with ``--late_hook`` after ``dscore.initialize``) records whether the group was still
alive when it ran, destroys it, and records whether that freed the group object (nothing, dscore or the
torch modules it imported, kept a reference: only then does destroying the group join its worker threads
while Python is alive). ``--user_inflight``: the user leaves collectives of its own in flight on its group
before exiting (its hook's ``destroy_process_group`` must end them).
"""

from __future__ import annotations

import argparse
import atexit
import os
import sys
import time
import weakref

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--local_rank", type=int, default=-1)
p.add_argument("--stage", type=int, default=0)
p.add_argument("--end", choices=["normal", "sys_exit", "exception", "ctrl_c"], default="normal")
p.add_argument("--user_group", action="store_true")
p.add_argument("--late_hook", action="store_true")
p.add_argument("--user_inflight", action="store_true")
p.add_argument("--out", required=True)
args = p.parse_args()
torch.set_num_threads(1)


def _user_hook() -> None:
    rank = dist.get_rank() if dist.is_initialized() else "X"
    with open(os.path.join(args.out, f"user_hook{rank}"), "w") as fh:
        fh.write(str(dist.is_initialized()))
    if dist.is_initialized():
        group = weakref.ref(dist.group.WORLD)
        dist.destroy_process_group()
        with open(os.path.join(args.out, f"user_freed{rank}"), "w") as fh:
            fh.write(str(group() is None))


if args.user_group:
    dist.init_process_group("gloo")
    if not args.late_hook:
        atexit.register(_user_hook)

import dscore  # noqa: E402
import dscore.comm as dcomm  # noqa: E402

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
config = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": args.stage},
}
engine, *_ = dscore.initialize(model=model, config=config)
if args.user_group and args.late_hook:
    atexit.register(_user_hook)  # runs before dscore's own exit hook
for _ in range(3):
    loss = engine(torch.randn(2, 4)).pow(2).mean()
    engine.backward(loss)
    engine.step()
engine.save_checkpoint(os.path.join(args.out, "ckpt"))


class SlowTeardown:
    def __del__(self) -> None:
        time.sleep(0.5)


slow = SlowTeardown()
if not args.user_group:  # the user's own group: ending it (and its in-flight work) is the user's business
    for _ in range(20):
        dcomm.all_reduce(torch.ones(1 << 14), async_op=True)
elif args.user_inflight:  # ... which its hook does, with torch.distributed itself
    for _ in range(20):
        dist.all_reduce(torch.ones(1 << 14), async_op=True)
if args.end == "sys_exit":
    sys.exit(0)
if args.end == "exception":
    raise RuntimeError("failure after training")
if args.end == "ctrl_c":
    raise KeyboardInterrupt
