"""Rank jobs of test_compat_comm.py: every ``deepspeed.comm`` call against torch.distributed's own result
on the same inputs (module-level so the spawned ranks can import them)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

CPU = torch.device("cpu")


def _same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    assert torch.equal(a, b), f"{what}: {a} != {b}"


def _refused(fn: Any, *needles: str) -> str:
    from dscore.errors import DistributedError

    try:
        fn()
    except DistributedError as exc:
        text = str(exc)
        for needle in needles:
            assert needle in text, f"{needle!r} not in {text!r}"
        return text
    raise AssertionError(f"expected a DistributedError naming {needles}")


def comm_job() -> dict[str, Any]:
    """One spawn, many checks; returns the names of the checks run and a few values for the parent."""
    import deepspeed.comm as ds

    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2
    done: list[str] = []
    gen = torch.Generator(device=CPU).manual_seed(1234 + rank)

    def rand(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=CPU).to(dtype)

    # ---- ReduceOp: DeepSpeed's enum, torch's, dscore's strings, on every reducing call
    base = rand(5)
    ints = torch.tensor([rank + 1, 6 - rank, 3 * rank + 2], dtype=torch.int64, device=CPU)
    for ds_op, torch_op, name in (
        (ds.ReduceOp.SUM, dist.ReduceOp.SUM, "sum"), (ds.ReduceOp.MAX, dist.ReduceOp.MAX, "max"),
        (ds.ReduceOp.MIN, dist.ReduceOp.MIN, "min"), (ds.ReduceOp.PRODUCT, dist.ReduceOp.PRODUCT, "product"),
    ):
        want = base.clone()
        dist.all_reduce(want, op=torch_op)
        for op in (ds_op, torch_op, name):
            got = base.clone()
            ds.all_reduce(got, op=op)
            _same(got, want, f"all_reduce {op}")
    for ds_op, torch_op in ((ds.ReduceOp.BAND, dist.ReduceOp.BAND), (ds.ReduceOp.BOR, dist.ReduceOp.BOR),
                            (ds.ReduceOp.BXOR, dist.ReduceOp.BXOR)):
        want, got = ints.clone(), ints.clone()
        dist.all_reduce(want, op=torch_op)
        ds.all_reduce(got, op=ds_op)
        _same(got, want, f"all_reduce {ds_op}")
    avg = base.clone()
    ds.all_reduce(avg, op=ds.ReduceOp.AVG)
    want = base.clone()
    dist.all_reduce(want)
    assert torch.allclose(avg, want / world)
    assert [m.value for m in ds.ReduceOp] == list(range(9)) and ds.ReduceOp.UNUSED.value == 8
    _refused(lambda: ds.all_reduce(base.clone(), op=ds.ReduceOp.UNUSED), "unknown reduce op", "ReduceOp.UNUSED")
    done.append("reduce_ops")

    # ---- inference_all_reduce, all_reduce_coalesced (mixed dtypes and shapes)
    got = base.clone()
    assert ds.inference_all_reduce(got) is None
    want = base.clone()
    dist.all_reduce(want)
    _same(got, want, "inference_all_reduce")
    tensors = [rand(3, 2), rand(4), ints.clone(), rand(2, dtype=torch.float64)]
    wants = [t.clone() for t in tensors]
    for t in wants:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    work = ds.all_reduce_coalesced(tensors, op=ds.ReduceOp.MAX, async_op=True)
    work.wait()
    for i, (g, w) in enumerate(zip(tensors, wants)):
        _same(g, w, f"all_reduce_coalesced[{i}]")
    assert ds.all_reduce_coalesced([rand(2)]) is None
    done.append("all_reduce_coalesced")

    # ---- reduce (sum, max, avg) to each destination
    for dst in range(world):
        for op, torch_op in ((ds.ReduceOp.SUM, dist.ReduceOp.SUM), (ds.ReduceOp.MAX, dist.ReduceOp.MAX)):
            got, want = base.clone(), base.clone()
            ds.reduce(got, dst, op=op)
            dist.reduce(want, dst, op=torch_op)
            if rank == dst:
                _same(got, want, f"reduce {op} dst={dst}")
        got = base.clone()
        ds.reduce(got, dst, op="avg", async_op=True).wait()
        want = base.clone()
        dist.reduce(want, dst)
        if rank == dst:
            assert torch.allclose(got, want / world), "reduce avg"
    _refused(lambda: ds.reduce(base.clone(), 5), "reduce", "dst=5")
    done.append("reduce")

    # ---- reduce_scatter_fn / allgather_fn / all_gather_coalesced
    full = rand(6)
    got, want = torch.empty(3, device=CPU), torch.empty(3, device=CPU)
    ds.reduce_scatter_fn(got, full.clone(), op=ds.ReduceOp.SUM)
    dist.reduce_scatter_tensor(want, full.clone())
    _same(got, want, "reduce_scatter_fn")
    part = rand(4)
    got, want = torch.empty(8, device=CPU), torch.empty(8, device=CPU)
    ds.allgather_fn(got, part)
    dist.all_gather_into_tensor(want, part)
    _same(got, want, "allgather_fn")
    ins = [rand(2), rand(3, 1)]
    outs = [torch.empty(4, device=CPU), torch.empty(6, 1, device=CPU)]
    ds.all_gather_coalesced(outs, ins)
    for i, (o, x) in enumerate(zip(outs, ins)):
        w = torch.empty_like(o)
        dist.all_gather_into_tensor(w, x)
        _same(o, w, f"all_gather_coalesced[{i}]")
    _refused(lambda: ds.all_gather_coalesced([torch.empty(3, device=CPU)], ins), "output_tensors", "input_tensors")
    _refused(lambda: ds.all_gather_coalesced([torch.empty(3, device=CPU), outs[1]], ins), "output_tensors[0]")
    done.append("fn_and_coalesced")

    # ---- all_to_all_single: even, uneven (split sizes), multi-dim rows
    x = rand(4, 3)
    got, want = torch.empty(4, 3, device=CPU), torch.empty(4, 3, device=CPU)
    ds.all_to_all_single(got, x)
    dist.all_to_all_single(want, x)
    _same(got, want, "all_to_all_single even")
    in_split = [1, 3] if rank == 0 else [2, 0]  # rank 0 sends 1 row to itself, 3 to rank 1; rank 1 sends 2, 0
    out_split = [1, 2] if rank == 0 else [3, 0]
    x = rand(sum(in_split), 2)
    got = torch.empty(sum(out_split), 2, device=CPU)
    want = torch.empty_like(got)
    work = ds.all_to_all_single(got, x, output_split_sizes=out_split, input_split_sizes=in_split, async_op=True)
    work.wait()
    dist.all_to_all_single(want, x, output_split_sizes=out_split, input_split_sizes=in_split)
    _same(got, want, "all_to_all_single uneven")
    _refused(lambda: ds.all_to_all_single(got, x, out_split, [1, 5]), "input_split_sizes", "summing to dim 0")
    swapped = [out_split[1] + 1, out_split[0] - 1] if rank == 0 else [out_split[0] - 1, out_split[1] + 1]
    _refused(lambda: ds.all_to_all_single(got, x, swapped, in_split), "this rank's own chunk")
    _refused(lambda: ds.all_to_all_single(got, x, [9], in_split), "output_split_sizes", "2 non-negative sizes")
    _refused(lambda: ds.all_to_all_single(torch.empty(3, 2, device=CPU), rand(3, 2)), "does not divide", "3")
    _refused(lambda: ds.all_to_all_single(torch.empty(4, 5, device=CPU), rand(4, 2)), "trailing dimensions")
    done.append("all_to_all_single")

    # ---- all_to_all (lists; gloo lacks it: torch's reference is built from point-to-point)
    ins = [rand(2 + r + rank, 1) for r in range(world)]  # to rank r: (2 + r + rank) rows
    outs = [torch.empty(2 + rank + q, 1, device=CPU) for q in range(world)]  # from rank q
    ds.all_to_all(outs, ins)
    ref = [torch.empty_like(o) for o in outs]
    peer = 1 - rank
    ref[rank].copy_(ins[rank])
    reqs = [dist.isend(ins[peer].contiguous(), peer), dist.irecv(ref[peer], peer)]
    for r in reqs:
        r.wait()
    for q in range(world):
        _same(outs[q], ref[q], f"all_to_all[{q}]")
    _refused(lambda: ds.all_to_all(outs[:1], ins), "output_tensor_list", "2 tensors")
    done.append("all_to_all")

    # ---- gather / scatter to and from each root
    t = rand(2, 2)
    for root in range(world):
        got = [torch.empty(2, 2, device=CPU) for _ in range(world)] if rank == root else None
        want = [torch.empty(2, 2, device=CPU) for _ in range(world)] if rank == root else None
        ds.gather(t, got, dst=root)
        dist.gather(t, want, dst=root)
        if rank == root:
            for a, b in zip(got, want):
                _same(a, b, f"gather dst={root}")
        chunks = [rand(3) for _ in range(world)] if rank == root else None
        got1, want1 = torch.empty(3, device=CPU), torch.empty(3, device=CPU)
        ds.scatter(got1, chunks, src=root)
        dist.scatter(want1, chunks, src=root)
        _same(got1, want1, f"scatter src={root}")
    if rank == 0:
        _refused(lambda: ds.gather(t, [t.clone()], dst=0), "gather_list", "2 tensors")
        _refused(lambda: ds.scatter(t, None, src=0), "scatter_list")
    else:
        _refused(lambda: ds.gather(t, [t.clone(), t.clone()], dst=0), "gather_list must be None")
    done.append("gather_scatter")

    # ---- point-to-point: send/recv (any source), isend/irecv, batch_isend_irecv with P2POp
    msg = torch.arange(4, dtype=torch.float32, device=CPU) + 10 * rank
    box = torch.empty(4, device=CPU)
    if rank == 0:
        ds.send(msg, 1, tag=3)
        sender = ds.recv(box, tag=4)
    else:
        sender = ds.recv(box, None, tag=3)
        ds.send(msg, 0, tag=4)
    assert sender == peer
    _same(box, torch.arange(4, dtype=torch.float32, device=CPU) + 10 * peer, "send/recv")
    box2 = torch.empty(4, device=CPU)
    works = [ds.isend(msg, peer), ds.irecv(box2, peer)]
    for w in works:
        w.wait()
    _same(box2, box, "isend/irecv")
    box3 = torch.empty(4, device=CPU)
    reqs = ds.batch_isend_irecv([ds.P2POp(ds.isend, msg, peer), ds.P2POp(ds.irecv, box3, peer)])
    assert len(reqs) == 2
    for r in reqs:
        r.wait()
    _same(box3, box, "batch_isend_irecv")
    _refused(lambda: ds.P2POp(ds.send, msg, peer), "P2POp", "isend")
    done.append("p2p")

    # ---- barriers
    ds.barrier()
    ds.barrier(async_op=True).wait()
    ds.monitored_barrier(wait_all_ranks=True)
    done.append("barriers")

    # ---- objects
    slots: list[Any] = [None, None]
    ds.all_gather_object(slots, {"rank": rank, "v": [rank] * (rank + 1)})
    assert slots == [{"rank": 0, "v": [0]}, {"rank": 1, "v": [1, 1]}], slots
    _refused(lambda: ds.all_gather_object([None], 1), "object_list", "one per rank")
    objs: list[Any] = ["root", {"k": 3}] if rank == 0 else [None, None]
    ds.broadcast_object_list(objs, 0)
    assert objs == ["root", {"k": 3}], objs
    done.append("objects")

    # ---- queries and logger accessors
    assert ds.get_backend() == "gloo"
    assert ds.get_world_group() is dist.group.WORLD
    assert ds.get_all_ranks_from_group() == [0, 1]
    sub = ds.new_group([1])
    if rank == 1:
        assert ds.get_all_ranks_from_group(sub) == [1]
    assert ds.has_all_gather_into_tensor() and ds.has_reduce_scatter_tensor() and ds.has_all_reduce_coalesced()
    assert ds.has_coalescing_manager() == hasattr(dist.distributed_c10d, "_coalescing_manager")
    ds.reset_log()
    ds.configure(enabled=True, prof_all=True)
    try:
        ds.reduce(base.clone(), 0)
        ds.all_to_all_single(torch.empty(4, 3, device=CPU), rand(4, 3))
        ds.all_reduce_coalesced([rand(2), rand(3)])
        logged = ds.get_logged_comm_ops()
        count = ds.get_comm_operation_count()
        has = ds.has_comm_data()
    finally:
        ds.configure(enabled=False)
    ds.reset_log()
    assert logged == ["reduce", "all_to_all_single", "all_reduce_coalesced"], logged
    assert count == 3 and has and not ds.has_comm_data()
    done.append("queries_logger")
    return {"done": done, "rank": rank}
