"""Every collective of the ``Comm`` facade on 2 real gloo ranks, against plain torch.distributed.

Each collective runs twice: natively and with the exact emulation forced (``emulate=``), which is the
path older gloo builds (no AVG, no reduce-scatter) take.
"""

from __future__ import annotations

from dscore.testing import run_distributed


def _check_all_collectives() -> dict[str, bool]:
    import torch
    import torch.distributed as dist

    import dscore.comm
    from dscore.comm import EMULABLE_OPS, Comm

    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(100 + rank)
    checked: dict[str, bool] = {}

    def same(name: str, got: torch.Tensor, ref: torch.Tensor) -> None:
        assert got.dtype == ref.dtype and got.shape == ref.shape, (name, got.shape, ref.shape)
        assert torch.equal(got, ref), f"{name}: rank {rank} got {got} expected {ref}"
        checked[name] = True

    for mode, emulate in (("native", ()), ("emulated", tuple(EMULABLE_OPS))):
        comm = Comm(None, backend="gloo", emulate=emulate)
        assert comm.get_rank() == rank and comm.get_world_size() == world

        # all_reduce: sum / max / min / avg (sync and async)
        for op, ref_op in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX), ("min", dist.ReduceOp.MIN)):
            x = torch.randn(3, 5, generator=gen)
            got, ref = x.clone(), x.clone()
            comm.all_reduce(got, op=op)
            dist.all_reduce(ref, op=ref_op)
            same(f"{mode}/all_reduce/{op}", got, ref)
        x = torch.randn(7, generator=gen, dtype=torch.float64)
        ref = x.clone()
        dist.all_reduce(ref)
        ref /= world
        for async_op in (False, True):
            got = x.clone()
            work = comm.all_reduce(got, op="avg", async_op=async_op)
            if async_op:
                assert work is not None
                work.wait()
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-15)
            checked[f"{mode}/all_reduce/avg/async={async_op}"] = True
        ints = torch.tensor([rank + 1, 10 * (rank + 1)])
        comm.all_reduce(ints, op="sum")
        same(f"{mode}/all_reduce/int", ints, torch.tensor([3, 30]))

        # reduce_scatter_tensor: input world*n, output n
        inp = torch.randn(world * 4, generator=gen)
        full = inp.clone()
        dist.all_reduce(full)
        for async_op in (False, True):
            out = torch.empty(4)
            work = comm.reduce_scatter_tensor(out, inp, op="sum", async_op=async_op)
            if async_op:
                work.wait()
            same(f"{mode}/reduce_scatter_tensor/async={async_op}", out, full[rank * 4 : (rank + 1) * 4])
        out = torch.empty(2, 2)
        comm.reduce_scatter_tensor(out, inp, op="avg")
        torch.testing.assert_close(out, (full / world)[rank * 4 : (rank + 1) * 4].view(2, 2))
        out_max = torch.empty(4)
        comm.reduce_scatter_tensor(out_max, inp, op="max")
        ref_max = inp.clone()
        dist.all_reduce(ref_max, op=dist.ReduceOp.MAX)
        same(f"{mode}/reduce_scatter_tensor/max", out_max, ref_max[rank * 4 : (rank + 1) * 4])

        # reduce_scatter with a list of per-rank inputs
        inputs = [torch.randn(2, 3, generator=gen) for _ in range(world)]
        stacked = torch.stack(inputs)
        dist.all_reduce(stacked)
        out = torch.empty(2, 3)
        comm.reduce_scatter(out, inputs, op="sum")
        same(f"{mode}/reduce_scatter", out, stacked[rank])

        # all_gather_into_tensor and all_gather
        mine = torch.arange(6, dtype=torch.float32).view(2, 3) + 100 * rank
        ref_list = [torch.empty(2, 3) for _ in range(world)]
        dist.all_gather(ref_list, mine)
        out = torch.empty(world * 2, 3)
        comm.all_gather_into_tensor(out, mine)
        same(f"{mode}/all_gather_into_tensor", out, torch.cat(ref_list))
        got_list = [torch.empty(2, 3) for _ in range(world)]
        comm.all_gather(got_list, mine)
        same(f"{mode}/all_gather", torch.stack(got_list), torch.stack(ref_list))

        # broadcast from each source
        for src in range(world):
            t = torch.full((4,), float(rank))
            comm.broadcast(t, src=src)
            same(f"{mode}/broadcast/src={src}", t, torch.full((4,), float(src)))

        # objects and barrier
        assert comm.all_gather_object({"rank": rank}) == [{"rank": r} for r in range(world)]
        assert comm.broadcast_object("hello" if rank == 0 else None, src=0) == "hello"
        comm.barrier()

        # a sub-group: collectives on it, and a facade bound to it
        group = comm.new_group([0, 1])
        t = torch.ones(2) * (rank + 1)
        comm.all_reduce(t, group=group)
        same(f"{mode}/new_group/all_reduce", t, torch.full((2,), 3.0))
        sub = comm.bound_to(group)
        assert sub.get_world_size() == world

    # module-level functions (no runtime: a facade over the default group)
    t = torch.ones(3)
    dscore.comm.all_reduce(t, op="avg")
    same("dscore.comm.all_reduce", t, torch.ones(3))
    assert dscore.comm.get_rank() == rank and dscore.comm.get_world_size() == world
    assert dscore.comm.get_local_rank() == rank  # run_distributed sets LOCAL_RANK = rank
    dscore.comm.barrier()
    return checked


def test_every_collective_matches_torch_distributed_on_two_gloo_ranks() -> None:
    results = run_distributed(_check_all_collectives, 2, timeout=150)
    assert results[0] == results[1]
    names = {name.split("/")[1] for name in results[0] if "/" in name}
    assert {"all_reduce", "reduce_scatter_tensor", "reduce_scatter", "all_gather_into_tensor", "all_gather",
            "broadcast", "new_group"} <= names
    assert any(n.startswith("emulated/") for n in results[0]) and any(n.startswith("native/") for n in results[0])


def test_errors_are_clear_without_a_process_group() -> None:
    import pytest

    from dscore.comm.facade import Comm, reduce_op
    from dscore.errors import DistributedError

    with pytest.raises(DistributedError, match="unknown reduce op 'median'; valid:"):
        reduce_op("median")
    with pytest.raises(DistributedError, match="cannot emulate"):
        Comm(emulate=("broadcast",))
