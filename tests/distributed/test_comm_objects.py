"""dscore's object collectives (``dscore.comm.objects``, the facade's ``all_gather_object`` /
``broadcast_object``) on 3 real gloo ranks, with torch's numpy-backed object path made to fail.

torch's ``all_gather_object`` / ``broadcast_object_list`` decode with ``tensor.numpy()`` (issue 38 item 0:
"Numpy is not available" on an install without numpy); here that decoder raises in every rank, so a call
that still goes through torch's object collectives fails the test.
"""

from __future__ import annotations

import pytest

from dscore.testing import run_distributed

pytestmark = pytest.mark.slow


def _refuse_torch_object_decoding() -> None:
    import torch.distributed.distributed_c10d as c10d

    def refuse(*args, **kwargs):
        raise AssertionError("torch's object collective decoder ran (it needs numpy)")

    c10d._tensor_to_object = refuse


def _check_objects() -> dict:
    import torch
    import torch.distributed as dist

    from dscore.comm import Comm
    from dscore.comm.objects import all_gather_object, broadcast_object, object_device

    _refuse_torch_object_decoding()
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = Comm(None, backend="gloo")
    # payloads of very different lengths (padding), a tensor, and a large one
    mine = {"rank": rank, "blob": b"x" * (rank * 70_000), "t": torch.arange(rank + 1, dtype=torch.float64)}
    every = comm.all_gather_object(mine)
    assert [o["rank"] for o in every] == list(range(world))
    assert [len(o["blob"]) for o in every] == [r * 70_000 for r in range(world)]
    assert all(torch.equal(o["t"], torch.arange(r + 1, dtype=torch.float64)) for r, o in enumerate(every))
    for src in range(world):
        got = comm.broadcast_object(("from", rank, [rank] * (rank + 2)), src=src)
        assert got == ("from", src, [src] * (src + 2)), (src, got)

    # a sub-group of global ranks 1 and 2: its ranks, src as a global rank, a facade bound to it
    group = comm.new_group([1, 2])
    out: dict = {"device": str(object_device(None))}
    if rank in (1, 2):
        out["sub_gather"] = all_gather_object(f"r{rank}", group)
        out["sub_broadcast"] = broadcast_object(rank * 10 if rank == 2 else None, src=2, group=group)
        sub = comm.bound_to(group)
        out["bound_gather"] = sub.all_gather_object(rank)
        out["bound_broadcast"] = sub.broadcast_object("one" if rank == 1 else "", src=1)
    comm.barrier()
    # agree() rides on all_gather_object: a failure on rank 0 reaches every rank
    try:
        comm.agree(ValueError("bad input") if rank == 0 else None, "a phase")
    except Exception as exc:  # noqa: BLE001 - the error is the result
        out["agree"] = str(exc)
    # an object one rank cannot pickle: every rank raises (no rank waits for a payload that never comes),
    # and the group still works afterwards
    unpicklable = (lambda: None) if rank == 1 else rank
    try:
        comm.all_gather_object(unpicklable)
    except Exception as exc:  # noqa: BLE001 - the error is the result
        out["gather_failure"] = f"{type(exc).__name__}: {exc}"
    try:
        broadcast_object(unpicklable, src=1)
    except Exception as exc:  # noqa: BLE001 - the error is the result
        out["broadcast_failure"] = f"{type(exc).__name__}: {exc}"
    out["after"] = comm.all_gather_object(rank)
    return out


def test_object_collectives_do_not_use_torch_decoder() -> None:
    results = run_distributed(_check_objects, 3, timeout=120)
    assert all(r["device"] == "cpu" for r in results)  # a gloo group exchanges host tensors
    for r in (1, 2):
        assert results[r]["sub_gather"] == ["r1", "r2"]
        assert results[r]["sub_broadcast"] == 20
        assert results[r]["bound_gather"] == [1, 2]
        assert results[r]["bound_broadcast"] == "one"
    assert "sub_gather" not in results[0]
    assert all(r["agree"] == "a phase failed (on rank 0): ValueError: bad input" for r in results)
    for res in results:
        assert res["gather_failure"].startswith(
            "DistributedError: all_gather_object: the object of rank(s) [1] cannot be pickled"
        ), res
        assert res["broadcast_failure"].startswith(
            "DistributedError: broadcast_object: the object of source rank 1 cannot be pickled"
        ), res
        assert res["after"] == [0, 1, 2]
