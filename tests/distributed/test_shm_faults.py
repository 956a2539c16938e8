"""Fault injection on the same-host shared-memory transport (issue 27), and two jobs on one host.

Rank 1 (the victim) dies, with SIGKILL, at each phase of an exchange: before launching it, after
launching it (before waiting), after waiting it, and at a random moment while both ranks run exchanges
back to back; or it is stopped with SIGSTOP past a short ``DSCORE_SHM_TIMEOUT``. Rank 0 must then either
get the right result (the victim posted before it died: its memory stays readable) or a
``DistributedError`` naming rank 1, within seconds — never a wrong result, another exception or a hang.
Each collective the transport carries is tried: all-reduce (small and large), reduce-scatter, all-gather.

These jobs start their own processes (``run_distributed`` treats a dying rank as a failure).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import threading
import time
from typing import Any

import pytest

from dscore.testing import find_free_port, run_distributed

_N_SMALL = 100
_N_LARGE = 300_000


def _launch_all(comm: Any, rank: int, world: int) -> list[tuple[str, Any, Any, Any]]:
    import torch

    out = []
    for name, n in (("all_reduce small", _N_SMALL), ("all_reduce large", _N_LARGE)):
        t = torch.full((n,), float(rank + 1), device="cpu")
        out.append((name, comm.all_reduce(t, async_op=True), t, torch.full((n,), float(sum(range(1, world + 1))))))
    inp = torch.cat([torch.full((1000,), float(10 * q + rank), device="cpu") for q in range(world)])
    rs = torch.empty(1000, device="cpu")
    out.append(("reduce_scatter", comm.reduce_scatter_tensor(rs, inp, async_op=True), rs,
                torch.full((1000,), float(sum(10 * rank + q for q in range(world))))))
    ag = torch.empty(world * 5000, device="cpu")
    out.append(("all_gather", comm.all_gather_into_tensor(ag, torch.full((5000,), float(rank), device="cpu"),
                                                          async_op=True), ag,
                torch.cat([torch.full((5000,), float(q)) for q in range(world)])))
    return out


def _fault_worker(rank: int, world: int, port: int, scenario: str, results: Any) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1"})
    if scenario == "sigstop":
        os.environ["DSCORE_SHM_TIMEOUT"] = "2"
    try:
        import torch
        import torch.distributed as dist

        from dscore.comm import Comm
        from dscore.errors import DistributedError
        from dscore_plugins.comm.shm import channel_for

        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
        comm = Comm(None, backend="gloo")
        comm.all_reduce(torch.zeros(4, device="cpu"))  # sets the channel up
        pids: list[int] = [0] * world
        dist.all_gather_object(pids, os.getpid())
        assert channel_for(None, world, rank) is not None
        if rank == 1:  # the victim
            if scenario == "before":
                os.kill(os.getpid(), signal.SIGKILL)
            if scenario == "during":
                while True:
                    for _, w, _, _ in _launch_all(comm, rank, world):
                        w.wait()
            works = _launch_all(comm, rank, world)
            if scenario == "after_wait":
                for _, w, _, _ in works:
                    w.wait()
            if scenario == "sigstop":
                for _, w, _, _ in works:
                    w.wait()
                dist.barrier()
                time.sleep(600)  # stopped by rank 0 before this ends; killed by the test afterwards
            os.kill(os.getpid(), signal.SIGKILL)  # after_launch / after_wait
        # rank 0, the survivor
        outcome: dict[str, Any] = {"errors": [], "right": [], "wrong": [], "seconds": []}
        early = _launch_all(comm, rank, world) if scenario in ("after_launch", "after_wait") else None
        if scenario in ("before", "after_launch", "after_wait"):
            fd = os.pidfd_open(pids[1])
            import select

            ready, _, _ = select.select([fd], [], [], 120)  # the victim is gone before rank 0 goes on
            assert ready
        if scenario == "sigstop":
            for _, w, _, _ in _launch_all(comm, rank, world):
                w.wait()
            dist.barrier()
            os.kill(pids[1], signal.SIGSTOP)
        killer = None
        if scenario == "during":
            killer = threading.Timer(0.5 + (os.getpid() % 7) / 10, os.kill, (pids[1], signal.SIGKILL))
            killer.start()
        for _ in range(10_000 if scenario == "during" else 1):
            try:
                works = early if early is not None else _launch_all(comm, rank, world)
            except DistributedError as exc:  # a TCP part could fail at launch too
                outcome["errors"].append(("launch", str(exc)))
                break
            failed = False
            for name, w, got, want in works:
                t0 = time.monotonic()
                try:
                    w.wait()
                except DistributedError as exc:
                    outcome["errors"].append((name, str(exc)))
                    outcome["seconds"].append(time.monotonic() - t0)
                    failed = True
                    if scenario == "sigstop":
                        break  # one timeout is the evidence; each further one costs 2 s
                    continue
                (outcome["right"] if torch.equal(got, want) else outcome["wrong"]).append(name)
            if failed or scenario == "sigstop" and outcome["errors"]:
                break
        if killer is not None:
            killer.join()
        if scenario == "sigstop":
            os.kill(pids[1], signal.SIGCONT)
            os.kill(pids[1], signal.SIGKILL)
        results.put((rank, "ok", outcome))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        import traceback

        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    results.close()
    results.join_thread()  # the message is written before the process ends
    os._exit(0)  # no process-group teardown: the peer is dead


def _run_fault(scenario: str) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = find_free_port()
    procs = [ctx.Process(target=_fault_worker, args=(r, 2, port, scenario, results), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        while True:
            rank, status, value = results.get(timeout=240)
            if status == "error":
                raise AssertionError(f"{scenario}: rank {rank} failed:\n{value}")
            if rank == 0:
                return value
    except queue.Empty:
        raise AssertionError(f"{scenario}: rank 0 did not finish (a hang)") from None
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(30)


_KINDS = ["all_reduce small", "all_reduce large", "reduce_scatter", "all_gather"]


def test_a_killed_or_stopped_peer_is_named_or_its_posted_data_read() -> None:
    scenarios = ["before", "after_launch", "after_wait", "during", "sigstop"]
    outcomes: dict[str, Any] = {}
    errors: list[str] = []

    def run(s: str) -> None:
        try:
            outcomes[s] = _run_fault(s)
        except AssertionError as exc:
            errors.append(str(exc))

    threads = [threading.Thread(target=run, args=(s,)) for s in scenarios]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for s, o in outcomes.items():
        assert not o["wrong"], (s, o)
        for _, message in o["errors"]:
            assert "rank 1" in message, (s, message)
        assert all(sec < 60 for sec in o["seconds"]), (s, o["seconds"])  # seconds, not the 1800 s default
    # before: nothing was posted, every wait names the dead rank
    assert [n for n, _ in outcomes["before"]["errors"]] == _KINDS, outcomes["before"]
    assert all("exited" in m for _, m in outcomes["before"]["errors"])
    # posted before dying: everything readable and right
    assert outcomes["after_launch"]["right"] == _KINDS and not outcomes["after_launch"]["errors"]
    assert outcomes["after_wait"]["right"] == _KINDS and not outcomes["after_wait"]["errors"]
    # during: some rounds right, then the death is named
    assert outcomes["during"]["errors"], outcomes["during"]
    # stopped: named after DSCORE_SHM_TIMEOUT=2 s
    assert outcomes["sigstop"]["errors"] and "DSCORE_SHM_TIMEOUT" in outcomes["sigstop"]["errors"][0][1]


def _job(tag: float) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from dscore.comm import Comm
    from dscore_plugins.comm.shm import channel_for

    rank, world = dist.get_rank(), dist.get_world_size()
    comm = Comm(None, backend="gloo")
    pids: list[int] = [0] * world
    dist.all_gather_object(pids, os.getpid())
    for k in range(60):
        t = torch.full((1000 + k,), tag + rank, device="cpu")
        comm.all_reduce(t)
        assert torch.equal(t, torch.full((1000 + k,), world * tag + sum(range(world)))), (tag, k)
        out = torch.empty(world * 50, device="cpu")
        comm.all_gather_into_tensor(out, torch.full((50,), tag * 10 + rank, device="cpu"))
        assert torch.equal(out, torch.cat([torch.full((50,), tag * 10 + q) for q in range(world)])), (tag, k)
    channel = channel_for(None, world, rank)
    assert channel is not None
    return {"pids": pids, "peer_pids": sorted(p.pid for p in channel.peers if p is not None)}


def test_two_jobs_on_one_host_never_see_each_others_segments() -> None:
    results: dict[float, Any] = {}

    def run(tag: float) -> None:
        results[tag] = run_distributed(_job, 2, tag, timeout=300)

    threads = [threading.Thread(target=run, args=(tag,)) for tag in (1.0, 1000.0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(results) == {1.0, 1000.0}
    for tag, ranks in results.items():
        job_pids = set(ranks[0]["pids"])
        for r in ranks:  # every mapped peer is a rank of this job
            assert set(r["peer_pids"]) <= job_pids and r["peer_pids"], (tag, r)
    assert not set(results[1.0][0]["pids"]) & set(results[1000.0][0]["pids"])


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])
