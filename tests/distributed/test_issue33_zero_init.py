"""Issue 33 items 4 and 10: ``dscore.zero.Init`` when a constructor touches a partitioned parameter,
and ``zero.Init`` before any process group under a launcher.

Item 4 (DeepSpeed PR #1202): a subclass ``__init__`` writing ``self.lin.weight.fill_(0.25)`` after its
parent built ``lin`` killed the rank with SIGSEGV (the released parameter keeps its shape over 0 bytes).
Now the write gathers the unit for that call and the value lands on every rank's partition.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dscore.errors import DistributedError
from dscore.testing import run_distributed


def _build_and_read() -> dict[str, Any]:
    import torch.distributed as dist

    import dscore

    rank = dist.get_rank()

    class Parent(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(6, 5)
            self.head = torch.nn.Linear(5, 3)

    class Child(Parent):
        def __init__(self) -> None:
            super().__init__()
            with torch.no_grad():
                self.lin.weight.fill_(0.25)  # the report's line
                self.lin.bias[1:3].fill_(-1.0)  # a view of the gathered storage, written after the call
                torch.manual_seed(100 + rank)  # every rank draws other numbers: rank 0's must win
                torch.nn.init.normal_(self.head.weight)
            self.total = float(self.lin.weight.sum())  # a read of a partitioned parameter

    with dscore.zero.Init():
        model = Child()
    unit = dscore.zero.partition.unit_of(model.lin.weight)
    released = unit is not None and not unit.gathered
    with dscore.zero.GatheredParameters(list(model.parameters())):
        values = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"released": released, "total": model.total, "values": values}


def test_zero_init_constructor_writes_to_partitioned_parameters_land() -> None:
    r0, r1 = run_distributed(_build_and_read, 2, timeout=240)
    for r in (r0, r1):
        assert r["released"]  # still partitioned after the build
        assert r["total"] == pytest.approx(0.25 * 30)
        assert torch.equal(r["values"]["lin.weight"], torch.full((5, 6), 0.25))
        assert torch.equal(r["values"]["lin.bias"][1:3], torch.full((2,), -1.0))
    for name in r0["values"]:
        assert torch.equal(r0["values"][name], r1["values"][name]), name
    # rank 0's normal_ draw is what both ranks hold (seed 100)
    torch.manual_seed(100)
    assert torch.equal(r0["values"]["head.weight"], torch.nn.init.normal_(torch.empty(3, 5)))


def test_zero_init_before_the_process_group_names_the_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    import dscore

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(DistributedError, match=r"WORLD_SIZE=2.*dscore.init_distributed\(\)"):
        with dscore.zero.Init():
            torch.nn.Linear(2, 2)
