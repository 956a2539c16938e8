"""The one ``Comm``: async ``Work`` handles, one-rank short cuts, the gloo fast paths against gloo's own
collectives (``DSCORE_GLOO_NATIVE=1``), in-place inputs, ``agree`` and ``bound_to`` a sub-group, on 2 real
gloo ranks (and without any process group)."""

from __future__ import annotations

import pytest
import torch

from dscore.testing import run_distributed


def _two_ranks() -> dict[str, object]:
    import os

    import torch.distributed as dist

    from dscore.comm import Comm, Work
    from dscore.errors import CheckpointError, DistributedError

    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, object] = {}

    # Work: wait() is idempotent and runs the finishing step exactly once
    calls: list[int] = []
    t = torch.full((4,), float(rank + 1))
    work = Work([dist.all_reduce(t, async_op=True)], lambda: calls.append(1))
    assert not work.is_completed()
    work.wait()
    work.wait()
    assert calls == [1] and work.is_completed() and torch.equal(t, torch.full((4,), 3.0))

    results = {}
    for mode in ("fast", "native"):
        os.environ["DSCORE_GLOO_NATIVE"] = "1" if mode == "native" else "0"
        comm = Comm(None, backend="gloo")
        assert comm.gloo_fast() is (mode == "fast")
        gen = torch.Generator().manual_seed(7 + rank)
        inp = torch.randn(world * 5, generator=gen)
        full = inp.clone()
        dist.all_reduce(full)
        # reduce-scatter whose output is this rank's slice of a reusable input (what the ZeRO reducer does)
        buf = inp.clone()
        own = buf[rank * 5 : (rank + 1) * 5]
        # (on every path: gloo's native call receives into a temporary)
        comm.reduce_scatter_tensor(own, buf, async_op=True, input_reusable=True).wait()
        assert torch.equal(own, full[rank * 5 : (rank + 1) * 5])
        # a non-reusable input is left as it was
        keep = inp.clone()
        got = torch.empty(5)
        comm.reduce_scatter_tensor(got, keep, op="avg")
        assert torch.equal(keep, inp)
        torch.testing.assert_close(got, full[rank * 5 : (rank + 1) * 5] / world)
        # all-gather whose input is this rank's chunk of the output
        gathered = torch.zeros(world * 3)
        gathered[rank * 3 : (rank + 1) * 3] = torch.arange(3.0) + 10 * rank
        comm.all_gather_into_tensor(gathered, gathered[rank * 3 : (rank + 1) * 3], async_op=True).wait()
        results[mode] = (got.tolist(), gathered.tolist())
    os.environ.pop("DSCORE_GLOO_NATIVE", None)
    assert results["fast"] == results["native"]
    out["gathered"] = results["fast"][1]

    # agree: one rank's failure is the same error on every rank; success returns every payload
    comm = Comm(None, backend="gloo")
    assert comm.agree(None, "phase", payload=rank) == list(range(world))
    err = CheckpointError("disk full") if rank == 1 else None
    with pytest.raises(CheckpointError, match=r"disk full \(on rank 1\)"):
        comm.agree(err, "writing", error_types=(CheckpointError,), default_error=DistributedError)
    with pytest.raises(DistributedError, match=r"reading failed \(on rank 0\): OSError: gone"):
        comm.agree(OSError("gone") if rank == 0 else None, "reading")

    # bound_to: a Comm over a sub-group holding only global rank 1
    group = comm.new_group([1])
    if rank == 1:
        sub = comm.bound_to(group)
        assert (sub.rank, sub.world_size, sub.global_rank(0)) == (0, 1, 1)
        x = torch.ones(2)
        assert sub.all_reduce(x, async_op=True).is_completed() and torch.equal(x, torch.ones(2))
    comm.barrier()
    return out


@pytest.mark.slow
def test_work_fast_paths_agree_and_subgroups_on_two_gloo_ranks() -> None:
    results = run_distributed(_two_ranks, 2, timeout=150)
    assert results[0]["gathered"] == results[1]["gathered"] == [0.0, 1.0, 2.0, 10.0, 11.0, 12.0]


def test_one_process_without_a_group_is_rank_0_of_1() -> None:
    from dscore.comm import Comm

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        pytest.skip("a process group exists in this process")
    comm = Comm(None)
    assert (comm.rank, comm.world_size, comm.gloo_fast()) == (0, 1, False)
    src = torch.arange(4.0)
    out = torch.empty(4)
    work = comm.reduce_scatter_tensor(out, src, async_op=True)
    assert work is not None and work.is_completed() and torch.equal(out, src)
    gathered = torch.empty(4)
    assert comm.all_gather_into_tensor(gathered, src) is None and torch.equal(gathered, src)
    assert comm.all_gather_object({"a": 1}) == [{"a": 1}]
    assert comm.agree(None, "phase", payload=5) == [5]
