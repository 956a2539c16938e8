"""A 2-rank job for the clean-exit tests (run through ``dscore run``; not a test module).

Trains a tiny MLP a few steps at ZeRO stage ``--stage``, saves a checkpoint, then leaves collectives in
flight (async all-reduces nobody waits for) and an object whose finalizer takes a moment, and ends as
``--end`` says. Without dscore ending its process group before interpreter finalization, gloo's worker
threads then drop those collectives' tensors during finalization, need the GIL, are ended by
``pthread_exit`` through a ``noexcept`` frame, and the rank aborts (``terminate called without an active
exception``, SIGABRT, exit 134).

``--user_group``: the script creates the process group itself; its own atexit hook (registered before
dscore's) records whether the group was still alive when it ran, then destroys it.
"""

from __future__ import annotations

import argparse
import atexit
import os
import sys
import time

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--local_rank", type=int, default=-1)
p.add_argument("--stage", type=int, default=0)
p.add_argument("--end", choices=["normal", "sys_exit", "exception", "ctrl_c"], default="normal")
p.add_argument("--user_group", action="store_true")
p.add_argument("--out", required=True)
args = p.parse_args()
torch.set_num_threads(1)

if args.user_group:
    dist.init_process_group("gloo")

    def _user_hook() -> None:
        with open(os.path.join(args.out, f"user_hook{dist.get_rank() if dist.is_initialized() else 'X'}"), "w") as fh:
            fh.write(str(dist.is_initialized()))
        if dist.is_initialized():
            dist.destroy_process_group()

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
if args.end == "sys_exit":
    sys.exit(0)
if args.end == "exception":
    raise RuntimeError("failure after training")
if args.end == "ctrl_c":
    raise KeyboardInterrupt
