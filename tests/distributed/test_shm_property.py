"""Property test of dscore's collectives over generated schedules (issue 27), against gloo's own results.

A schedule is a list of collectives launched in the same order on every rank (the collective contract):
all_reduce sum/avg, reduce_scatter_tensor sum/avg, all_gather_into_tensor, all_gather and broadcast, in
fp32/bf16/int64, with per-rank element counts on both sides of every size threshold of the transport (an
outbox of ``DSCORE_SHM_BYTES`` = 1 MiB here, so single payloads above it and bursts that fill it go by TCP;
4096 descriptor slots per peer, crossed by long runs), blocking calls interleaved with async ones, each
rank waiting its works in its OWN random order at its own points, and some works never waited (their
outputs are not checked, but everything after them must still be right). Every checked output is
compared with gloo's native collective on copies of the same inputs (``torch.distributed`` directly),
and every input that is not an output must be unchanged. Data are small integers so sums are exact in
every dtype whatever the order.

Schedules are drawn by a seeded generator that every rank runs with the same seed (each rank's waits
from ``seed + rank``), so a failure names ``(seed, schedule)`` to replay. Many schedules run inside ONE
spawned job per world size (spawning per schedule would cost ~5 s each). The fast tier runs
``_FAST`` schedules (240 in all); the slow tier ``DSCORE_PROPERTY_SCHEDULES`` per world size (default 150, other
seeds; set it to thousands for a soak run). The same schedules run over gloo point-to-point
(``DSCORE_SHM=0``): 40 on 3 ranks in the fast tier, half the slow tier's count per world size in the slow one.
"""

from __future__ import annotations

import os
import random
from typing import Any

import pytest

from dscore.testing import run_distributed

_KINDS = ("all_reduce", "all_reduce_avg", "reduce_scatter", "reduce_scatter_avg", "all_gather_into_tensor",
          "all_gather", "broadcast")
# elements per rank chunk: tiny, around 16 Ki elements (64 KiB fp32), around the 1 MiB outbox (fp32:
# 262144 elements), and above it
_SIZES = (1, 3, 1000, 16383, 16384, 16385, 131072, 262143, 262145, 300000)
_OUTBOX = 1 << 20


def _draw_schedule(rng: random.Random, world: int) -> list[tuple[str, str, int, bool, int]]:
    """``[(kind, dtype name, n, async_op, src), ...]`` drawn identically on every rank."""
    ops = []
    for _ in range(rng.randint(1, 8)):
        kind = rng.choice(_KINDS)
        dtype = rng.choice(("float32", "bfloat16") if kind.endswith("_avg") else ("float32", "bfloat16", "int64"))
        n = rng.choice(_SIZES) if rng.random() < 0.6 else rng.randint(1, 5000)
        ops.append((kind, dtype, n, rng.random() < 0.6, rng.randrange(world)))
    return ops


def _data(seed: int, rank: int, n: int, dtype: Any) -> Any:
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed * 1009 + rank)
    return torch.randint(-8, 9, (n,), generator=gen, device="cpu").to(dtype)


def _launch(comm: Any, kind: str, dtype: Any, n: int, async_op: bool, src: int, rank: int, world: int,
            seed: int) -> tuple[Any, dict[str, Any]]:
    """Launch one collective through dscore's facade; returns (work or None, its tensors)."""
    import torch

    if kind.startswith("all_reduce"):
        t = _data(seed, rank, n, dtype)
        keep = {"inp": t.clone(), "out": t}
        return comm.all_reduce(t, op="avg" if kind.endswith("avg") else "sum", async_op=async_op), keep
    if kind.startswith("reduce_scatter"):
        inp = _data(seed, rank, world * n, dtype)
        out = torch.full((n,), -99, dtype=dtype, device="cpu")
        keep = {"inp": inp.clone(), "inp_live": inp, "out": out}
        op = "avg" if kind.endswith("avg") else "sum"
        return comm.reduce_scatter_tensor(out, inp, op=op, async_op=async_op), keep
    if kind == "all_gather_into_tensor":
        inp = _data(seed, rank, n, dtype)
        out = torch.full((world * n,), -99, dtype=dtype, device="cpu")
        return comm.all_gather_into_tensor(out, inp, async_op=async_op), {"inp": inp.clone(), "inp_live": inp, "out": out}
    if kind == "all_gather":
        inp = _data(seed, rank, n, dtype)
        outs = [torch.full((n,), -99, dtype=dtype, device="cpu") for _ in range(world)]
        return comm.all_gather(outs, inp, async_op=async_op), {"inp": inp.clone(), "inp_live": inp, "outs": outs}
    t = _data(seed, rank, n, dtype)
    return comm.broadcast(t, src, async_op=async_op), {"inp": t.clone(), "out": t}


def _reference(kind: str, keep: dict[str, Any], src: int, world: int, rank: int) -> Any:
    """gloo's own result of the same collective on copies of the inputs (blocking, torch.distributed)."""
    import torch
    import torch.distributed as dist

    inp = keep["inp"].clone()
    if kind.startswith("all_reduce"):
        dist.all_reduce(inp)
        return inp / world if kind.endswith("avg") else inp
    if kind.startswith("reduce_scatter"):
        n = inp.numel() // world
        dist.all_reduce(inp)  # gloo's reduce-scatter is an all-reduce plus a slice as well
        piece = inp[rank * n : (rank + 1) * n]
        return piece / world if kind.endswith("avg") else piece
    if kind in ("all_gather_into_tensor", "all_gather"):
        outs = [torch.empty_like(inp) for _ in range(world)]
        dist.all_gather(outs, inp)
        return torch.cat(outs)
    dist.broadcast(inp, src)
    return inp


def _run_schedules(base_seed: int, count: int, transport: str = "shm") -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from dscore.comm import Comm
    from dscore_plugins.comm.shm import channel_for

    rank, world = dist.get_rank(), dist.get_world_size()
    comm = Comm(None, backend="gloo")
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int64": torch.int64}
    checked = unwaited = 0
    kinds: dict[str, int] = {}
    for s in range(count):
        seed = base_seed + s
        rng = random.Random(seed)
        mine = random.Random(seed * 7919 + rank)  # this rank's own wait order
        schedule = _draw_schedule(rng, world)
        launched: list[tuple[int, Any, dict[str, Any]]] = []
        pending: list[int] = []
        never: set[int] = set()
        for i, (kind, dname, n, async_op, src) in enumerate(schedule):
            work, keep = _launch(comm, kind, dtypes[dname], n, async_op, src, rank, world, seed * 31 + i)
            launched.append((i, work, keep))
            if work is not None:
                if mine.random() < 0.15:
                    never.add(i)
                else:
                    pending.append(i)
            # wait a random subset of the pending works, in a random order of this rank's own
            if pending and mine.random() < 0.4:
                mine.shuffle(pending)
                k = mine.randint(1, len(pending))
                for j in pending[:k]:
                    launched[j][1].wait()
                del pending[:k]
        mine.shuffle(pending)
        for j in pending:
            launched[j][1].wait()
        # drop the never-waited works now: what follows must be right regardless
        for j in never:
            launched[j] = (j, None, launched[j][2])
        for i, (kind, _, _, _, src) in enumerate(schedule):
            keep = launched[i][2]
            want = _reference(kind, keep, src, world, rank)  # collective: run for every op on every rank
            if i in never:
                unwaited += 1
                continue
            got = torch.cat(keep["outs"]) if "outs" in keep else keep["out"]
            where = f"seed {seed} op {i} {schedule[i]} on rank {rank} of {world}; schedule {schedule}"
            assert torch.equal(got, want), f"wrong result: {where}"
            if "inp_live" in keep:
                assert torch.equal(keep["inp_live"], keep["inp"]), f"input changed: {where}"
            checked += 1
            kinds[kind] = kinds.get(kind, 0) + 1
    channel = channel_for(None, world, rank)
    assert (channel is not None) == (transport == "shm"), "the wrong transport was used"
    return {
        "schedules": count, "checked": checked, "unwaited": unwaited, "kinds": kinds,
        "shm_bytes": channel.shm_bytes if channel else 0, "tcp_bytes": channel.tcp_bytes if channel else 0,
    }


_FAST = {2: 120, 3: 70, 4: 50}


def _check(world: int, count: int, seed: int, transport: str = "shm") -> None:
    env = {"DSCORE_SHM_BYTES": str(_OUTBOX)} if transport == "shm" else {"DSCORE_SHM": "0"}
    results = run_distributed(_run_schedules, world, seed, count, transport, timeout=1800, env=env)
    assert all(r["schedules"] == count for r in results)
    assert all(set(r["kinds"]) == set(_KINDS) for r in results), results  # every kind drawn and checked
    assert all(r["unwaited"] > 0 for r in results)
    if transport == "shm":
        assert all(r["shm_bytes"] > 0 and r["tcp_bytes"] > 0 for r in results), results  # both sides of the limit
    checked, unwaited = sum(r["checked"] for r in results), sum(r["unwaited"] for r in results)
    print(f"{transport} world {world}: {count} schedules, {checked} rank-outputs checked, {unwaited} never waited")


@pytest.mark.parametrize("world", [2, 3, 4])
def test_generated_schedules_match_gloo(world: int) -> None:
    _check(world, _FAST[world], seed=1000 * world)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4])
def test_generated_schedules_match_gloo_soak(world: int) -> None:
    count = int(os.environ.get("DSCORE_PROPERTY_SCHEDULES", "150"))
    _check(world, count, seed=10_000_000 + 1_000_000 * world)


# the same schedules over gloo point-to-point (DSCORE_SHM=0, the multi-node path): launch-time posting there
# too, and works never waited must keep their transfers alive (test_p2p_unwaited.py has the minimal case)
_FAST_P2P = {3: 40}


def test_generated_schedules_match_gloo_point_to_point() -> None:
    _check(3, _FAST_P2P[3], seed=20_000_000, transport="p2p")  # seed 20000009 hung before issue 27's fix


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4])
def test_generated_schedules_match_gloo_point_to_point_soak(world: int) -> None:
    count = int(os.environ.get("DSCORE_PROPERTY_SCHEDULES", "150")) // 2
    _check(world, count, seed=30_000_000 + 1_000_000 * world, transport="p2p")
