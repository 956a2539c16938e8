"""``run_distributed`` survives its port being taken between picking and binding (the whole job is
started again on a new port)."""

from __future__ import annotations

import socket

import pytest

import dscore.testing.distributed as harness
from dscore.testing import DistributedTestFailure, run_distributed

pytestmark = pytest.mark.slow


def _rank_and_port():
    import os

    import torch.distributed as dist

    return dist.get_rank(), int(os.environ["MASTER_PORT"])


def test_a_taken_port_is_retried_on_a_new_one(monkeypatch: pytest.MonkeyPatch) -> None:
    thief = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    thief.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    thief.bind(("0.0.0.0", 0))
    thief.listen(8)
    taken = int(thief.getsockname()[1])
    real = harness.find_free_port
    handed: list[int] = []

    def first_one_taken() -> int:
        port = taken if not handed else real()
        handed.append(port)
        return port

    monkeypatch.setattr(harness, "find_free_port", first_one_taken)
    try:
        out = run_distributed(_rank_and_port, 2, timeout=120)
    finally:
        thief.close()
    assert handed[0] == taken and len(handed) >= 2
    assert [r for r, _ in out] == [0, 1]
    assert out[0][1] == out[1][1] != taken


def _fails():
    raise ValueError("not a port problem")


def test_other_failures_are_not_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = harness.find_free_port
    monkeypatch.setattr(harness, "find_free_port", lambda: calls.append(1) or real())
    with pytest.raises(DistributedTestFailure, match="not a port problem"):
        run_distributed(_fails, 2, timeout=120)
    assert len(calls) == 1
