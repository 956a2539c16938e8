"""Run a function on N real processes forming a gloo process group on loopback.

The shape follows DeepSpeed's ``DistributedTest`` (tests/unit/common.py): real processes, real
collectives, failures propagated to the test. Differences: ranks are forked from a fresh single-purpose
server process (``multiprocessing``'s forkserver, which has imported torch once and holds no threads of
the test process), each rank's exception text and traceback reach pytest, and when one rank fails the
others are killed at once instead of hanging in a collective.

Start method: the forkserver saves importing torch in every rank of every call (about 2-10 s per 2-rank
job, more on a loaded machine). Each rank still gets the caller's current ``os.environ``, ``sys.path`` and
working directory, as a spawned process would. ``DSCORE_TEST_START_METHOD=spawn`` starts every rank as a
fresh interpreter instead.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["DistributedTestFailure", "find_free_port", "run_distributed"]


class DistributedTestFailure(AssertionError):
    """One or more ranks failed; the message holds each failing rank's traceback."""


def find_free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    env: dict[str, str],
    init_process_group: bool,
    results: Any,
    parent_env: dict[str, str] | None = None,
) -> None:
    if parent_env is not None:  # a forked rank: the caller's environment now, not the server's at its start
        os.environ.clear()
        os.environ.update(parent_env)
    os.environ.update(env)
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
        }
    )
    try:
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        if init_process_group:
            import torch.distributed as dist

            dist.init_process_group("gloo", rank=rank, world_size=world_size, init_method=f"tcp://127.0.0.1:{port}")
        value = fn(*args, **kwargs)
        # plain pickle bytes: through the queue, torch would send a tensor as a shared-memory file descriptor
        # the parent fetches from this process later, which fails once the rank has exited (FileNotFoundError)
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException as exc:  # report everything, SystemExit included
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        try:
            import torch.distributed as dist

            if init_process_group and dist.is_initialized():
                from dscore.comm.transports import flush_pending_sends

                flush_pending_sends()  # as dscore's own destroy does: deliver what peers still wait for
                dist.destroy_process_group()
        except Exception:
            pass
        if parent_env is not None:
            import atexit

            # a forked rank ends in os._exit(): run the exit hooks a spawned rank's interpreter would run
            atexit._run_exitfuncs()


_FORKSERVER_PRELOAD = ["torch", "torch.distributed"]


def _context() -> Any:
    """The multiprocessing context ranks start from (see the module docstring)."""
    method = os.environ.get("DSCORE_TEST_START_METHOD", "forkserver")
    if method not in ("forkserver", "spawn") or method not in mp.get_all_start_methods():
        method = "spawn"
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_FORKSERVER_PRELOAD)  # read when the server starts (first call)
    return ctx


_ADDRESS_IN_USE = ("eaddrinuse", "address already in use")
_PORT_ATTEMPTS = 4


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    *args: Any,
    timeout: float = 180.0,
    env: dict[str, str] | None = None,
    init_process_group: bool = True,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` spawned processes and return each rank's result.

    Each process gets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1``, a fresh
    ``MASTER_PORT`` and ``OMP_NUM_THREADS=1`` (override through ``env``); with ``init_process_group``
    it also joins a gloo default process group before ``fn`` runs. ``fn`` and its arguments must be
    picklable (a module-level function of an importable module).

    The port is picked free, but another process may take it before rank 0 listens (a loaded machine
    running many jobs): when a rank fails with "address already in use", the whole job is started again
    on a new port (up to 4 attempts), so ``fn`` must tolerate being run again from the start.

    Returns:
        ``[result_rank0, result_rank1, ...]`` (results must be picklable).

    Raises:
        DistributedTestFailure: a rank raised (its traceback is in the message), died without
            reporting, or the job exceeded ``timeout`` seconds; surviving ranks are killed first.
    """
    for attempt in range(1, _PORT_ATTEMPTS + 1):
        outcomes, failures = _spawn(fn, world_size, args, kwargs, timeout, dict(env or {}), init_process_group)
        if not failures:
            return [outcomes[r][1] for r in range(world_size)]
        text = "\n".join(failures)
        if attempt < _PORT_ATTEMPTS and any(marker in text.lower() for marker in _ADDRESS_IN_USE):
            continue  # the port was taken between picking and binding: start over on a new one
        raise DistributedTestFailure(text)
    raise AssertionError("unreachable")


def _spawn(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    timeout: float,
    env: dict[str, str],
    init_process_group: bool,
) -> tuple[dict[int, tuple[str, Any]], list[str]]:
    """One attempt: start the ranks on a fresh port; return ``(outcomes by rank, failure messages)``."""
    ctx = _context()
    results = ctx.Queue()
    port = find_free_port()
    parent_env = dict(os.environ) if ctx.get_start_method() == "forkserver" else None
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, world_size, port, fn, args, kwargs, env, init_process_group, results, parent_env),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    outcomes: dict[int, tuple[str, Any]] = {}
    failures: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while len(outcomes) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(outcomes))
                failures.append(f"timed out after {timeout:.0f}s waiting for rank(s) {missing}")
                break
            try:
                rank, status, value = results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                dead = [
                    r for r, p in enumerate(procs) if r not in outcomes and p.exitcode is not None
                ]
                if dead:
                    # give a dying rank's queued message a moment to arrive
                    try:
                        rank, status, value = results.get(timeout=2.0)
                    except queue.Empty:
                        failures.extend(f"rank {r} died with exit code {procs[r].exitcode}" for r in dead)
                        break
                else:
                    continue
            outcomes[rank] = (status, pickle.loads(value) if status == "ok" else value)
            if status == "error":
                failures.append(f"rank {rank} failed:\n{value}")
                break
    finally:
        if failures:
            for p in procs:
                if p.is_alive():
                    p.kill()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
    return outcomes, failures
