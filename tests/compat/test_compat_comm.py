"""``deepspeed.comm`` made whole (issue 39): DeepSpeed's collectives, point-to-point, object calls, queries
and ReduceOp on dscore.comm, each checked against torch.distributed on 2 gloo ranks (one spawn)."""

from __future__ import annotations

import comm_jobs  # tests/compat is on sys.path: pytest's prepend import mode
import pytest
import torch

from dscore.errors import DistributedError
from dscore.testing import run_distributed

CHECKS = ["reduce_ops", "all_reduce_coalesced", "reduce", "fn_and_coalesced", "all_to_all_single", "all_to_all",
          "gather_scatter", "p2p", "barriers", "objects", "queries_logger"]


def test_every_call_matches_torch_on_two_ranks() -> None:
    results = run_distributed(comm_jobs.comm_job, 2, timeout=240)
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["done"] == CHECKS


def test_reduce_op_enum_and_refusals_without_a_group() -> None:
    import deepspeed.comm as ds
    import torch.distributed as dist

    from dscore.comm import reduce_op

    assert issubclass(ds.ReduceOp, __import__("enum").Enum)
    assert reduce_op(ds.ReduceOp.AVG) == dist.ReduceOp.AVG
    assert reduce_op(ds.ReduceOp.BXOR) == dist.ReduceOp.BXOR
    assert reduce_op(dist.ReduceOp.MIN) == dist.ReduceOp.MIN
    with pytest.raises(DistributedError, match="unknown reduce op"):
        reduce_op(ds.ReduceOp.UNUSED)
    with pytest.raises(DistributedError, match="unknown reduce op"):
        reduce_op(3)
    if not dist.is_initialized():
        with pytest.raises(DistributedError, match="init_distributed"):
            ds.has_all_gather_into_tensor()
        with pytest.raises(DistributedError, match="init_distributed"):
            ds.get_world_group()
    with pytest.raises(AttributeError, match="not provided"):
        ds.no_such_call  # noqa: B018
    assert callable(ds.all_to_all_single) and torch.distributed is dist
