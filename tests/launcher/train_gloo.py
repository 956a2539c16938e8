"""Standalone 2-rank gloo training used by the launcher tests (no dscore import).

Reads the launcher's variables, joins a gloo process group, runs a few data-parallel SGD steps
(gradients averaged with ``all_reduce``), checks that every rank ends with the same parameters, and
writes ``<out>/rank<R>.json``. ``--fail_rank R``: that rank exits 1 while the others wait in a barrier
(it first writes ``<out>/failed``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", required=True)
    p.add_argument("--fail_rank", type=int, default=-1)
    p.add_argument("extra", nargs="*")
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    assert args.local_rank in (-1, int(os.environ["LOCAL_RANK"])), (args.local_rank, os.environ["LOCAL_RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if rank == args.fail_rank:
        open(os.path.join(args.out, "failed"), "w").close()
        sys.exit(1)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + rank)  # different data per rank
    for _ in range(args.steps):
        x = torch.randn(8, 4, generator=gen)
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        for prm in model.parameters():
            dist.all_reduce(prm.grad)
            prm.grad /= world
        opt.step()
        dist.barrier()
    flat = torch.cat([prm.detach().flatten() for prm in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    for other in gathered:
        assert torch.equal(other, flat), "parameters differ across ranks"
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as fh:
        json.dump(
            {
                "rank": rank,
                "world": world,
                "params": flat.tolist(),
                "argv": sys.argv,
                "cross_rank": os.environ.get("CROSS_RANK"),
            },
            fh,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # This fixture tests the launcher, not torch's exit path: a plain-torch gloo script can still be
    # killed by SIGABRT ("terminate called without an active exception") during interpreter finalization
    # even after destroy_process_group (seen here ~1 run in 40). dscore's own scripts are protected by its
    # process-group owner (dscore.comm.init); this script imports no dscore, so it leaves without finalization.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
