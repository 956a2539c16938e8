"""``dscore.comm.exit_drain``: gloo's worker threads count as parked only when they are in their run loop's
idle wait, never while a collective is running or blocked on a peer (asleep, using no CPU: what the
quiet-time heuristic before it took for idle). Real gloo ranks on loopback."""

from __future__ import annotations

import pytest

from dscore.testing import run_distributed


def _blocked_on_peer():
    import time
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from dscore.comm.exit_drain import _worker_states, drain_backend_workers

    store = dist.distributed_c10d._get_default_store()
    seen = {}
    assert drain_backend_workers(30.0)  # nothing launched: parked
    if dist.get_rank() == 0:
        work = dist.all_reduce(torch.ones(1 << 10, device="cpu"), async_op=True)  # rank 1 has not launched yet
        # sample until the worker has taken the collective (it is blocked on rank 1 until "go" is set); a
        # sample taken at once may find it before that, or not yet listed
        deadline = time.monotonic() + 10.0
        seen["blocked"] = _worker_states()
        while "busy" not in (seen["blocked"] or []) and time.monotonic() < deadline:
            time.sleep(0.01)
            seen["blocked"] = _worker_states()
        seen["drained_while_blocked"] = drain_backend_workers(0.5)
        store.set("test/drain/go", "1")
        work.wait()
    else:
        store.wait(["test/drain/go"], timedelta(seconds=120))
        dist.all_reduce(torch.ones(1 << 10, device="cpu"))
    seen["drained"] = drain_backend_workers(30.0)
    seen["after"] = _worker_states()
    return seen


def test_a_worker_blocked_on_its_peer_is_busy_not_idle() -> None:
    out = run_distributed(_blocked_on_peer, 2, timeout=180)
    assert "busy" in out[0]["blocked"], out[0]
    assert out[0]["drained_while_blocked"] is False
    for rank in (0, 1):
        assert out[rank]["drained"] is True
        assert out[rank]["after"] and set(out[rank]["after"]) == {"parked"}, out[rank]


@pytest.mark.parametrize(("text", "value"), [("", 30.0), ("0", 0.0), ("2.5", 2.5), ("soon", 30.0), ("-1", 30.0)])
def test_the_limit_variable(text: str, value: float) -> None:
    from dscore.comm.exit_drain import EXIT_DRAIN_ENV, exit_drain_limit

    assert exit_drain_limit({EXIT_DRAIN_ENV: text}) == value
