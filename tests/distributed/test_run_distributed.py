"""The multi-process helper itself: real gloo ranks, failures propagated with their text."""

from __future__ import annotations

import time

import pytest

from dscore.testing import DistributedTestFailure, run_distributed


def _all_reduce_rank() -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item()


def _rank1_fails_rank0_waits() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise AssertionError("rank one says no")
    dist.barrier()  # would hang forever without the helper killing it


def test_all_reduce_across_two_ranks() -> None:
    assert run_distributed(_all_reduce_rank, 2) == [3.0, 3.0]


def test_failure_text_reaches_pytest_and_no_hang() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestFailure, match="rank 1 failed:\nAssertionError: rank one says no"):
        run_distributed(_rank1_fails_rank0_waits, 2, timeout=60)
    assert time.monotonic() - start < 45
