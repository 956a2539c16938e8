"""Fault evidence for :mod:`dscore.rollout.weight_sync` (issue 40 item 4): a peer killed (SIGKILL) at each phase of a
sync — before the header, in the middle of a bucket (metadata sent, bytes not), before END — makes the survivor
raise WeightSyncError naming the dead peer's pid within a bounded time (well under the group's timeout: a dead
peer's connections close at once), never hang; a peer that stops answering (SIGSTOP) fails the survivor after the
group's timeout. The kill is armed in the victim process by wrapping a transport method (test code only).

One survivor process per role runs every scenario in turn on a fresh port; each victim is its own process."""

from __future__ import annotations

import os
import queue
import signal
import time
from typing import Any

import pytest
import torch

from dscore.testing import find_free_port

PHASES = ("before_header", "mid_bucket", "before_end")
N_TENSORS = 4  # _model()'s state dict; bucket_bytes=1 makes every tensor a bucket
VICTIM_TIMEOUT_S = 60.0


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))


def _engine() -> Any:
    import dscore

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(find_free_port()), "RANK": "0",
                       "LOCAL_RANK": "0", "WORLD_SIZE": "1"})
    engine, *_ = dscore.initialize(model=_model(), config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}})
    return engine


def _arm(role: str, phase: str, sig: int) -> None:
    """Make this process signal itself (``sig``) when its sync reaches ``phase``."""
    from dscore.rollout import weight_sync as ws

    def die() -> None:
        os.kill(os.getpid(), sig)
        time.sleep(3600)  # SIGSTOP: never go on once resumed (the test kills it)

    group = ws.WeightSyncGroup
    if role == "receiver":
        recv_frame, bcast, calls = group.recv_frame, group._bcast, [0]

        def recv_frame_hook(self: Any, step: Any) -> Any:
            calls[0] += 1
            # frames: HEADER, N_TENSORS buckets, END
            if (phase == "before_header" and calls[0] == 1) or (phase == "before_end" and calls[0] == N_TENSORS + 2):
                die()
            return recv_frame(self, step)

        def bcast_hook(self: Any, pg: Any, tensor: torch.Tensor, what: str, step: Any) -> None:
            if phase == "mid_bucket" and what.startswith("receiving bucket 1'"):
                die()
            bcast(self, pg, tensor, what, step)

        group.recv_frame = recv_frame_hook  # type: ignore[method-assign]
        group._bcast = bcast_hook  # type: ignore[method-assign]
    else:
        send_frame, bcast = group.send_frame, group._bcast

        def send_frame_hook(self: Any, kind: int, a: int, meta: Any, step: Any) -> None:
            if (phase == "before_header" and kind == ws.HEADER) or (phase == "before_end" and kind == ws.END):
                die()
            send_frame(self, kind, a, meta, step)

        def bcast_hook(self: Any, pg: Any, tensor: torch.Tensor, what: str, step: Any) -> None:
            if phase == "mid_bucket" and what.startswith("sending bucket 1'"):
                die()
            bcast(self, pg, tensor, what, step)

        group.send_frame = send_frame_hook  # type: ignore[method-assign]
        group._bcast = bcast_hook  # type: ignore[method-assign]


def _victim(role: str, phase: str, port: int, sig: int) -> None:
    from dscore.rollout.weight_sync import WeightSyncGroup, WeightSyncReceiver, WeightSyncSender

    torch.set_num_threads(1)
    engine = _engine() if role == "sender" else None
    _arm(role, phase, sig)
    g = WeightSyncGroup("127.0.0.1", port, 2, 0 if role == "sender" else 1, timeout=VICTIM_TIMEOUT_S,
                        rendezvous_timeout=120)
    if engine is not None:
        WeightSyncSender(engine, g, bucket_bytes=1).send(7)
    else:
        WeightSyncReceiver(g).receive(_model())
    raise AssertionError(f"the {role} victim passed phase {phase} alive")


def _survivor(role: str, scenarios: list[tuple[str, int, float]], results: Any) -> None:
    from dscore.errors import WeightSyncError
    from dscore.rollout.weight_sync import WeightSyncGroup, WeightSyncReceiver, WeightSyncSender

    torch.set_num_threads(1)
    engine = _engine() if role == "sender" else None
    for phase, port, timeout in scenarios:
        g = WeightSyncGroup("127.0.0.1", port, 2, 0 if role == "sender" else 1, timeout=timeout,
                            rendezvous_timeout=120)  # the victims start while earlier scenarios run
        start = time.monotonic()
        try:
            if engine is not None:
                WeightSyncSender(engine, g, bucket_bytes=1).send(7)
            else:
                WeightSyncReceiver(g).receive(_model())
            outcome: tuple[str, str, str] = ("returned", "", "")
        except WeightSyncError as exc:
            outcome = ("WeightSyncError", str(exc), exc.peer)
        except Exception as exc:  # reported, and the test fails on it
            outcome = (type(exc).__name__, str(exc), "")
        elapsed = time.monotonic() - start
        try:  # the failed group refuses a further sync at once
            if engine is not None:
                WeightSyncSender(engine, g, bucket_bytes=1).send(8)
            else:
                WeightSyncReceiver(g).receive(_model())
            refused = "returned"
        except WeightSyncError as exc:
            refused = str(exc)
        results.put((phase, *outcome, elapsed, refused))
        g.close()


@pytest.mark.slow
@pytest.mark.parametrize("dead", ["receiver", "sender"])
def test_a_peer_killed_at_each_phase_fails_the_survivor_naming_it(dead: str) -> None:
    from dscore.testing.distributed import _context

    ctx = _context()
    results = ctx.Queue()
    alive = "sender" if dead == "receiver" else "receiver"
    # every phase killed (SIGKILL); then, for the dead receiver, one that stops answering (SIGSTOP, 3 s bound)
    plan = [(p, signal.SIGKILL, 30.0) for p in PHASES]
    if dead == "receiver":
        plan.append(("mid_bucket", signal.SIGSTOP, 3.0))
    ports = [find_free_port() for _ in plan]
    victims = [ctx.Process(target=_victim, args=(dead, p, port, int(sig)), daemon=True)
               for (p, sig, _), port in zip(plan, ports)]
    survivor = ctx.Process(target=_survivor, args=(alive, [(p, port, t) for (p, _, t), port in zip(plan, ports)],
                                                   results), daemon=True)
    for proc in (survivor, *victims):
        proc.start()
    got = []
    try:
        for _ in plan:
            got.append(results.get(timeout=240))
    except queue.Empty:
        pytest.fail(f"the surviving {alive} hung: outcomes so far {got}, victims' exit codes "
                    f"{[v.exitcode for v in victims]}")
    finally:
        for proc in (survivor, *victims):
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=30)
    for (phase, sig, _), victim, (rphase, kind, message, peer, elapsed, refused) in zip(plan, victims, got):
        case = (dead, phase, signal.Signals(sig).name, message)
        assert rphase == phase and kind == "WeightSyncError", case
        assert f"pid {victim.pid}" in message and f"pid {victim.pid}" in peer, case  # names the dead peer
        assert ("receiver" if dead == "receiver" else "sender") in peer, case
        assert "close this group and rendezvous a new one" in refused, (case, refused)
        if sig == signal.SIGKILL:
            assert victim.exitcode == -signal.SIGKILL, case  # the victim really died at the armed phase
            assert elapsed < 15.0, case  # detected from the closed connection, not by waiting out the 30 s timeout
        else:
            assert 2.5 < elapsed < 15.0, case  # a silent peer: bounded by the group's 3 s timeout
