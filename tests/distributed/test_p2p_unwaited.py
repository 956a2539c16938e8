"""gloo point-to-point transport (``DSCORE_SHM=0``, the multi-node path): a ``Work`` dropped without ``wait()``.

The hang of issue 27's p2p soak (seed 20000009 on 3 ranks: an async ``all_gather_into_tensor`` that rank 1
never waited, then gloo's own all-reduce hung on every rank). A gloo ``isend``/``irecv`` owns its
transfer's buffer; dropping its handle before the transfer finished destroys that buffer while gloo's pair
still has it queued. The pair then can neither write the pending send (gloo's device thread retries it
forever, one core busy) nor read the peer's payload, so every later message on that pair, a native
collective's included, is stuck behind it. The transport now keeps the transfers of a dropped ``Work``
alive until they complete.

The ordering that triggers it is forced, not timed: the dropping rank drops its work before the other
rank launches the same collective (a store key orders them), so the transfers are pending at the drop.
A hang becomes a failure through ``run_distributed``'s timeout.
"""

from __future__ import annotations

import gc
from typing import Any

from dscore.testing import run_distributed


def _drop_then_collectives(world: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from dscore.comm import Comm
    from dscore_plugins.comm.shm import channel_for

    rank = dist.get_rank()
    comm = Comm(None, backend="gloo")
    store = dist.distributed_c10d._get_default_store()
    n = 16384
    results: dict[str, Any] = {}
    for kind in ("all_gather_into_tensor", "all_gather", "reduce_scatter_tensor"):
        mine = torch.arange(n, dtype=torch.int64, device="cpu") + 100_000 * rank
        if kind == "reduce_scatter_tensor":
            inp = torch.arange(world * n, dtype=torch.int64, device="cpu") * (rank + 1)
            out = torch.empty(n, dtype=torch.int64, device="cpu")
        else:
            out = torch.empty(world * n, dtype=torch.int64, device="cpu")
        dropper = 1
        if rank != dropper:
            store.wait([f"dropped-{kind}"])  # launch only once the dropping rank dropped its work
        if kind == "reduce_scatter_tensor":
            work = comm.reduce_scatter_tensor(out, inp, async_op=True)
        elif kind == "all_gather":
            work = comm.all_gather(list(out.split(n)), mine, async_op=True)
        else:
            work = comm.all_gather_into_tensor(out, mine, async_op=True)
        assert work is not None
        if rank == dropper:
            del work  # never waited: its transfers are still pending (no peer launched yet)
            gc.collect()
            store.set(f"dropped-{kind}", "1")
        else:
            work.wait()
            if kind == "reduce_scatter_tensor":
                want = torch.arange(rank * n, (rank + 1) * n, dtype=torch.int64) * sum(q + 1 for q in range(world))
            else:
                want = torch.cat([torch.arange(n, dtype=torch.int64) + 100_000 * q for q in range(world)])
            assert torch.equal(out, want), kind
        # then gloo's own collective on the same group, and the same collective again, waited everywhere
        total = torch.full((1000,), float(rank + 1), device="cpu")
        dist.all_reduce(total)
        assert torch.equal(total, torch.full((1000,), float(world * (world + 1) // 2))), kind
        again = torch.empty(world * n, dtype=torch.int64, device="cpu")
        comm.all_gather_into_tensor(again, mine)
        assert torch.equal(again, torch.cat([torch.arange(n, dtype=torch.int64) + 100_000 * q for q in range(world)]))
        results[kind] = True
    assert channel_for(None, world, rank) is None, "the shared-memory transport was used; this is the p2p test"
    return results


def test_a_dropped_point_to_point_work_leaves_the_group_usable() -> None:
    results = run_distributed(_drop_then_collectives, 3, 3, timeout=180, env={"DSCORE_SHM": "0"})
    assert all(len(r) == 3 for r in results)
