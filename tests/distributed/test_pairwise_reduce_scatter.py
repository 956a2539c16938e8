"""The gloo pairwise reduce-scatter and all-gather of ``Comm`` (sum/avg as a direct exchange of chunks) against
torch's all-reduce on real gloo ranks: 2 ranks (bitwise equal: a sum of two terms does not depend on
order) and 3 ranks (more than one peer per rank), fp32 and bf16, the list form, an output aliasing the
input's own chunk, several reduce-scatters in flight waited in reverse order, and point-to-point
traffic of the caller on tag 0 interleaved with them; and the pairwise all-gather against gloo's own.

Each runs over the three transports of the payloads (:mod:`dscore_plugins.comm.shm`): shared memory (the default
on one host), TCP behind the shared-memory tokens (an outbox limit of 1 byte), and plain gloo transfers
(``DSCORE_SHM=0``); large all-reduces, which go through shared memory too, are checked the same way."""

from __future__ import annotations

import pytest

from dscore.testing import run_distributed


def _check_pairwise() -> dict[str, object]:
    import torch
    import torch.distributed as dist

    from dscore.comm import Comm

    rank, world = dist.get_rank(), dist.get_world_size()
    comm = Comm(None, backend="gloo")
    assert comm.gloo_fast()
    checked = 0

    def reference(inp: torch.Tensor) -> torch.Tensor:
        full = inp.clone()
        dist.all_reduce(full)
        return full

    # several sizes (n = 1 and a size not a multiple of anything), fp32 and bf16; integer-valued data
    # so a 3-rank sum is exact whatever the order, random data on 2 ranks (bitwise equal either way)
    for dtype in (torch.float32, torch.bfloat16):
        for n in (1, 7, 4099):
            gen = torch.Generator().manual_seed(100 * n + rank)
            inp = torch.randn(world * n, generator=gen)
            if world > 2:
                inp = (inp * 8).round()
            inp = inp.to(dtype)
            full = reference(inp)
            keep = inp.clone()
            out = torch.empty(n, dtype=dtype)
            comm.reduce_scatter_tensor(out, inp)
            assert torch.equal(inp, keep), "a non-reusable input was written"
            assert torch.equal(out, full[rank * n : (rank + 1) * n]), (dtype, n)
            avg = torch.empty(n, dtype=dtype)
            comm.reduce_scatter_tensor(avg, inp, op="avg", async_op=True).wait()
            assert torch.equal(avg, full[rank * n : (rank + 1) * n] / world), (dtype, n)
            # output aliasing this rank's chunk of a reusable input (the ZeRO reducer's layout)
            buf = inp.clone()
            own = buf[rank * n : (rank + 1) * n]
            comm.reduce_scatter_tensor(own, buf, async_op=True, input_reusable=True).wait()
            assert torch.equal(own, full[rank * n : (rank + 1) * n])
            # the list form
            parts = [t.clone() for t in inp.split(n)]
            got = torch.empty(n, dtype=dtype)
            comm.reduce_scatter(got, parts)
            assert torch.equal(got, full[rank * n : (rank + 1) * n])
            checked += 4

    # four reduce-scatters in flight, with the caller's own tag-0 send/recv ring in between, waited in
    # reverse order: transfers pair up by posting order, not by completion
    inputs = [(torch.arange(world * 64, dtype=torch.float32) + 1000 * k + rank) for k in range(4)]
    outs = [torch.empty(64) for _ in inputs]
    works = []
    token_in = torch.empty(3)
    token_out = torch.full((3,), float(rank))
    for k, (o, i) in enumerate(zip(outs, inputs)):
        works.append(comm.reduce_scatter_tensor(o, i, async_op=True))
        if k == 1:
            works.append(comm.isend(token_out, (rank + 1) % world))
            works.append(comm.irecv(token_in, (rank - 1) % world))
    for w in reversed(works):
        w.wait()
    assert torch.equal(token_in, torch.full((3,), float((rank - 1) % world)))
    for o, i in zip(outs, inputs):
        assert torch.equal(o, reference(i)[rank * 64 : (rank + 1) * 64])
        checked += 1

    # the pairwise all-gather: from a separate input and from this rank's chunk of the output, against
    # gloo's own all-gather
    for dtype in (torch.float32, torch.bfloat16):
        for n in (1, 4099):
            mine = (torch.arange(n, dtype=torch.float32) + 10_000 * rank).to(dtype)
            want = torch.empty(world * n, dtype=dtype)
            dist.all_gather_into_tensor(want, mine.clone())
            got = torch.full((world * n,), -1.0, dtype=dtype)
            comm.all_gather_into_tensor(got, mine)
            assert torch.equal(got, want), (dtype, n)
            inplace = torch.full((world * n,), -1.0, dtype=dtype)
            inplace[rank * n : (rank + 1) * n] = mine
            comm.all_gather_into_tensor(inplace, inplace[rank * n : (rank + 1) * n], async_op=True).wait()
            assert torch.equal(inplace, want), (dtype, n)
            # the list form, into pieces of a larger buffer (as ZeRO's piecewise gathers)
            big = torch.full((world * (n + 2),), -1.0, dtype=dtype)
            outs = [big[q * (n + 2) : q * (n + 2) + n] for q in range(world)]
            comm.all_gather(outs, mine, async_op=True).wait()
            assert all(torch.equal(o, w) for o, w in zip(outs, want.split(n)))
            assert torch.equal(big.view(world, n + 2)[:, n:], torch.full((world, 2), -1.0, dtype=dtype))
            checked += 3

    # a non-sum op still goes through the all-reduce fallback
    x = torch.tensor([float(rank)] * world)
    mx = torch.empty(1)
    comm.reduce_scatter_tensor(mx, x, op="max")
    assert mx.item() == world - 1

    # all-reduces (on one host: one shared-memory exchange of the whole tensor, at every size) against
    # gloo's all-reduce; two in flight, waited in reverse order; integers and averages too
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for n in (1, 7, 1000, 40_000 * world + 1, 70_001):  # both sides of the former 64 KiB split
            gen = torch.Generator().manual_seed(7 * n + rank)
            data = torch.randn(n, generator=gen)
            if world > 2 or dtype == torch.int64:  # exact sums whatever gloo's order
                data = (data * 8).round()
            data = data.to(dtype)
            want, want_b = data.clone(), data * 2
            dist.all_reduce(want)
            dist.all_reduce(want_b)
            a, b = data.clone(), data * 2
            wa = comm.all_reduce(a, async_op=True)
            wb = comm.all_reduce(b, async_op=True)
            wb.wait()
            wa.wait()
            assert torch.equal(a, want), (dtype, n)
            assert torch.equal(b, want_b), (dtype, n)
            if dtype != torch.int64:
                avg = data.clone()
                comm.all_reduce(avg, op="avg")
                assert torch.equal(avg, want / world), (dtype, n)
            checked += 1

    from dscore_plugins.comm.shm import channel_for

    channel = channel_for(None, world, rank)
    transport = "off" if channel is None else ("shm" if channel.shm_bytes else "tcp")
    return {"checked": checked, "transport": transport}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("transport", ["shm", "tcp", "off"])
def test_pairwise_reduce_scatter_equals_all_reduce(world: int, transport: str) -> None:
    env = {"shm": {}, "tcp": {"DSCORE_SHM_BYTES": "1"}, "off": {"DSCORE_SHM": "0"}}[transport]
    results = run_distributed(_check_pairwise, world, timeout=180, env=env)
    assert [r["checked"] for r in results] == [55] * world
    assert [r["transport"] for r in results] == [transport] * world


def _check_outbox_limit() -> dict[str, object]:
    import torch
    import torch.distributed as dist

    from dscore.comm import Comm
    from dscore_plugins.comm.shm import channel_for

    rank, world = dist.get_rank(), dist.get_world_size()
    comm = Comm(None, backend="gloo")
    n = 1 << 20  # 4 MiB of fp32 per payload: four fit in the 16 MiB outbox, the rest go by TCP
    for round_ in range(3):
        mine = [torch.full((n,), float(100 * round_ + 10 * k + rank)) for k in range(6)]
        outs = [torch.empty(world * n) for _ in mine]
        works = [comm.all_gather_into_tensor(o, m, async_op=True) for o, m in zip(outs, mine)]
        for w in reversed(works):  # finished out of order: each TCP payload has its own tag
            w.wait()
        for k, o in enumerate(outs):
            want = torch.cat([torch.full((n,), float(100 * round_ + 10 * k + q)) for q in range(world)])
            assert torch.equal(o, want), (round_, k)
    # more exchanges in flight than a peer has descriptor slots (4096): the later ones go by gloo,
    # descriptor and payload, and still pair up when waited in reverse
    many = 4200
    mine = [torch.full((3,), float(k + 0.5 * rank)) for k in range(many)]
    outs = [torch.empty(world * 3) for _ in range(many)]
    works = [comm.all_gather_into_tensor(o, m, async_op=True) for o, m in zip(outs, mine)]
    for w in reversed(works):
        w.wait()
    for k, o in enumerate(outs):
        assert torch.equal(o, torch.cat([torch.full((3,), float(k + 0.5 * q)) for q in range(world)])), k
    channel = channel_for(None, world, rank)
    assert channel is not None
    return {
        "extents": len(channel.extents), "shm": channel.shm_bytes > 0, "tcp": channel.tcp_bytes > 0,
        "overflows": channel.overflows >= many - 4096,
    }


@pytest.mark.slow
def test_a_full_outbox_sends_by_tcp_and_regions_are_reused() -> None:
    results = run_distributed(_check_outbox_limit, 2, timeout=180, env={"DSCORE_SHM_BYTES": str(16 << 20)})
    assert results == [{"extents": 1, "shm": True, "tcp": True, "overflows": True}] * 2


def _one_rank_stays_silent() -> str:
    import time

    import torch
    import torch.distributed as dist

    from dscore.comm import Comm
    from dscore.errors import DistributedError

    comm = Comm(None, backend="gloo")
    x = torch.ones(8)
    comm.all_reduce(x)  # sets the channel up on both ranks
    if dist.get_rank() == 1:
        time.sleep(6)  # never posts the next all-reduce
        return "silent"
    t0 = time.monotonic()
    try:
        comm.all_reduce(x)
    except DistributedError as exc:
        return f"{time.monotonic() - t0:.1f} {exc}"
    return "no error"


@pytest.mark.slow
def test_a_silent_peer_is_named_after_the_timeout_instead_of_a_hang() -> None:
    results = run_distributed(_one_rank_stays_silent, 2, timeout=120, env={"DSCORE_SHM_TIMEOUT": "2"})
    assert results[1] == "silent"
    waited, _, message = results[0].partition(" ")
    assert "rank 1" in message and "DSCORE_SHM_TIMEOUT" in message, results[0]
    assert float(waited) >= 2.0


def _one_rank_leaves() -> str:
    import torch
    import torch.distributed as dist

    from dscore.comm import Comm
    from dscore.errors import DistributedError

    comm = Comm(None, backend="gloo")
    x = torch.ones(8)
    comm.all_reduce(x)
    if dist.get_rank() == 1:
        return "gone"  # the process exits without posting the next all-reduce
    try:
        comm.all_reduce(x)
    except DistributedError as exc:
        return str(exc)
    return "no error"


@pytest.mark.slow
def test_a_peer_that_exits_is_named_instead_of_a_hang() -> None:
    results = run_distributed(_one_rank_leaves, 2, timeout=120)
    assert results[1] == "gone"
    assert "rank 1" in results[0] and "exited" in results[0], results[0]
